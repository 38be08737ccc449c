"""An ordinary data-parallel PyTorch script (torch.distributed, gloo, launched torchrun-style): each
rank trains on its shard, gradients are all-reduced every step; every rank prints its loss per step
and the final weight checksum. With --hold FILE every rank waits, before its checksum, until FILE
exists (the test's signal that the job may end)."""

import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=150)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--hold", help="before the checksum, wait until this file exists")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(42)
model = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 4))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
generator = torch.Generator().manual_seed(1000 + rank)
data = torch.randn(256, 32, generator=generator)
labels = torch.randint(0, 4, (256,), generator=generator)

for step in range(args.steps):
    index = torch.randint(0, 256, (32,), generator=generator)
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(data[index]), labels[index])
    loss.backward()
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad)
        parameter.grad /= world
    optimizer.step()
    print(f"rank {rank} step {step} loss {loss.item():.10f}", flush=True)
    if args.sleep:
        time.sleep(args.sleep)

while args.hold and not os.path.exists(args.hold):
    time.sleep(0.05)

digest = hashlib.sha256()
for tensor in model.state_dict().values():
    digest.update(tensor.numpy().tobytes())
print(f"rank {rank} final weights sha256 {digest.hexdigest()}", flush=True)
dist.destroy_process_group()
