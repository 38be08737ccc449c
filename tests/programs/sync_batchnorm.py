"""DDP over a small CNN with SyncBatchNorm (`convert_sync_batchnorm`), launched torchrun-style.

Each rank trains on its own batches and prints, per step, its loss and, at the end, the running
statistics and weights it holds and one evaluation loss. With --single one process instead trains
the same model with plain BatchNorm on every rank's batch together, directly on the CPU: what
SyncBatchNorm computes across the ranks (its statistics and their gradients) is that, up to
rounding, so the two print the same figures. --channels-last runs the model channels-last.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--single", type=int, default=0, help="ranks whose batches one process trains on")
parser.add_argument("--channels-last", action="store_true")
options = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.BatchNorm2d(4, momentum=None),
    nn.Flatten(), nn.Linear(4 * 4 * 4, 3), nn.BatchNorm1d(3),
)  # fmt: skip
form = torch.channels_last if options.channels_last else torch.contiguous_format
ranks = list(range(options.single)) if options.single else [int(os.environ["RANK"])]
if options.single:
    device, net = "cpu", model
else:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    dist.init_process_group("nccl")
    device = "cuda"
    net = DistributedDataParallel(
        nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device, memory_format=form)
    )
optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
generators = {rank: torch.Generator().manual_seed(100 + rank) for rank in ranks}


def batch(rank: int) -> torch.Tensor:
    return torch.randn(5, 3, 8, 8, generator=generators[rank]).to(device, memory_format=form)


for step in range(options.steps):
    inputs = torch.cat([batch(rank) for rank in ranks])
    out = net(inputs)
    losses = (out**2).mean(dim=1).view(len(ranks), -1).mean(dim=1)  # each rank's own loss
    losses.mean().backward()  # DDP averages the ranks' gradients: one process, the mean of their losses
    optimizer.step()
    optimizer.zero_grad()
    for rank, loss in zip(ranks, losses.tolist(), strict=True):
        print(f"step {step} rank {rank} loss {loss!r}")
net.eval()
with torch.no_grad():
    evaluation = (
        (net(torch.cat([batch(rank) for rank in ranks])) ** 2).mean(dim=1).view(len(ranks), -1).mean(dim=1)
    )
for rank in ranks:
    print(f"eval rank {rank} loss {evaluation[ranks.index(rank)].item()!r}")
    for name, value in model.state_dict().items():
        print(f"rank {rank} {name} {value.double().sum().item()!r}")
if not options.single:
    dist.destroy_process_group()
