"""A small GAN written the way older, much-copied PyTorch code is: legacy tensor types
(`Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor`, `Tensor(n, 1).fill_(1.0)`,
`Tensor(numpy_array)`, `images.type(Tensor)`), `Variable`, a prefetcher that copies the next batch
on a side stream and calls `record_stream`, NVTX ranges, and the allocator's summary.

Prints each step's losses and the generator's checksum: the same on the CPU and on a device.
"""

import numpy as np
import torch
from _common import checksum
from torch import nn
from torch.autograd import Variable

cuda = torch.cuda.is_available()
Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor
torch.manual_seed(0)
np.random.seed(0)
latent = 8
generator = nn.Sequential(nn.Linear(latent, 32), nn.LeakyReLU(0.2), nn.Linear(32, 16), nn.Tanh())
discriminator = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1), nn.Sigmoid())
loss_of = nn.BCELoss()
if cuda:
    generator.cuda()
    discriminator.cuda()
    loss_of.cuda()
optimizer_g = torch.optim.Adam(generator.parameters(), lr=2e-3, betas=(0.5, 0.999))
optimizer_d = torch.optim.Adam(discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999))
batches = [torch.rand(12, 16).pin_memory() if cuda else torch.rand(12, 16) for _ in range(4)]


class Prefetcher:
    """Copies the next batch to the device on a side stream, as fast input pipelines do."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream() if cuda else None
        self.index = 0

    def next(self) -> torch.Tensor:
        batch = batches[self.index % len(batches)]
        self.index += 1
        if self.stream is None:
            return batch
        with torch.cuda.stream(self.stream):
            moved = batch.cuda(non_blocking=True)
        torch.cuda.current_stream().wait_stream(self.stream)
        moved.record_stream(torch.cuda.current_stream())
        return moved


prefetcher = Prefetcher()
for step in range(12):
    if cuda:
        torch.cuda.nvtx.range_push(f"step {step}")
    images = prefetcher.next()
    valid = Variable(Tensor(images.size(0), 1).fill_(1.0), requires_grad=False)
    fake = Variable(Tensor(images.size(0), 1).fill_(0.0), requires_grad=False)
    real = Variable(images.type(Tensor))
    optimizer_g.zero_grad()
    z = Variable(Tensor(np.random.normal(0, 1, (images.shape[0], latent))))
    generated = generator(z)
    g_loss = loss_of(discriminator(generated), valid)
    g_loss.backward()
    optimizer_g.step()
    optimizer_d.zero_grad()
    real_loss = loss_of(discriminator(real), valid)
    fake_loss = loss_of(discriminator(generated.detach()), fake)
    d_loss = (real_loss + fake_loss) / 2
    d_loss.backward()
    optimizer_d.step()
    if cuda:
        with torch.cuda.nvtx.range("report"):
            assert (
                isinstance(generated.data, torch.cuda.FloatTensor)
                and generated.type() == "torch.cuda.FloatTensor"
            )
        torch.cuda.nvtx.range_pop()
    print(f"step {step} d {d_loss.item()!r} g {g_loss.item()!r}", flush=True)
if cuda:
    assert "Allocated memory" in torch.cuda.memory_summary(abbreviated=True)
print("final", checksum(generator), flush=True)
