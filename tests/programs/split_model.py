"""A model split over two devices (model parallelism, as `device_map="auto"` splits large models):
each step clips the gradients of both halves together and steps them with foreach, fused and plain
optimizers, whose multi-tensor kernels group tensors by device. Prints losses and checksums."""

import sys

import torch
from torch import nn

device = sys.argv[1]
first, second = (f"{device}:0", f"{device}:1") if device == "cuda" else (device, device)
torch.manual_seed(0)
front, back = nn.Linear(6, 8).to(first), nn.Linear(8, 2).to(second)
parameters = [*front.parameters(), *back.parameters()]
optimizers = [
    torch.optim.SGD(parameters, lr=0.05, momentum=0.9, foreach=True),
    torch.optim.Adam(parameters, lr=0.01, fused=True),
    torch.optim.AdamW(parameters, lr=0.01),
]
for step in range(6):
    inputs = torch.randn(4, 6, device=first)
    loss = back(torch.relu(front(inputs)).to(second)).pow(2).mean()
    for optimizer in optimizers:
        optimizer.zero_grad()
    loss.backward()
    norm = nn.utils.clip_grad_norm_(parameters, 0.5)
    optimizers[step % len(optimizers)].step()
    print(f"step {step} loss {loss.item():.8f} norm {norm.item():.8f}")
print("checksum", [round(p.sum().item(), 8) for p in parameters])
