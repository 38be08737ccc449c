"""Times data-parallel training steps of a small model, torchrun-style, for the splicing bench.

Each rank trains a few linear layers under DistributedDataParallel (one allreduce per step) and
prints the mean wall time of a step after the warm-up. With --ballast MIB the job also holds that
many MiB of device tensors, split over its ranks (device state for a resize to move). With --hold
FILE every rank waits, after its steps, until FILE exists.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=50)
parser.add_argument("--warmup", type=int, default=5)
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--batch", type=int, default=64)
parser.add_argument("--ballast", type=int, default=0, help="MiB of device tensors the job holds")
parser.add_argument("--hold", help="after the steps, wait until this file exists")
args = parser.parse_args()

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
device = torch.device("cuda", torch.cuda.current_device())
dist.init_process_group("nccl")
torch.manual_seed(1)
ballast = torch.ones((args.ballast << 20) // world // 4, device=device)
net = nn.Sequential(*(nn.Linear(args.width, args.width) for _ in range(4))).to(device)
model = DistributedDataParallel(net, device_ids=[device.index])
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(args.batch, args.width, device=device)
began = 0.0
for step in range(args.warmup + args.steps):
    if step == args.warmup:
        began = time.perf_counter()
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()
    torch.cuda.synchronize()
step_ms = (time.perf_counter() - began) * 1000 / max(1, args.steps)
print(f"rank {rank} step_ms {step_ms:.3f}", flush=True)
while args.hold and not os.path.exists(args.hold):
    time.sleep(0.05)
print(f"rank {rank} ballast {float(ballast.sum()):.0f}", flush=True)
dist.destroy_process_group()
