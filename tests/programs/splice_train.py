"""Data-parallel training whose parameters and Adam state dominate its device memory.

Launched torchrun-style (RANK etc.), every rank prints its loss at each step and, at the end, a
checksum of its weights. After the last step the ranks meet at a barrier (a collective), say so
(--ready PREFIX: PREFIX + rank is created), and with --hold FILE wait until FILE exists (a test's
signal to end; it measures the device meanwhile).
With --different the ranks are not replicas: each starts from its own weights and trains alone
(no DDP), sharing only its loss through an all_reduce each step; with --groups-of N too, that
all_reduce is over groups of N ranks, by turns consecutive ranks and ranks N apart (a 2-D mesh's
tensor- and data-parallel groups), so no collective before the end has every rank in it.
With --seed-per-rank each rank seeds its own weights, as nanoGPT does, and DDP's first broadcast
makes them rank 0's: replicas; like nanoGPT (which evaluates first) it waits 3 s after DDP's
set-up before its first step.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from _common import checksum
from torch import nn
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--different", action="store_true", help="ranks with different weights, no DDP")
parser.add_argument(
    "--seed-per-rank", action="store_true", help="each rank seeds its own weights; DDP makes them rank 0's"
)
parser.add_argument("--groups-of", type=int, help="with --different: all_reduce over sub-groups this big")
parser.add_argument("--hold", help="after the last step, wait until this file exists")
parser.add_argument("--ready", help="after the barrier, create this path with the rank appended")
parser.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after each step")
args = parser.parse_args()

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
local = int(os.environ.get("LOCAL_RANK", rank))
torch.cuda.set_device(local % torch.cuda.device_count())
device = torch.device("cuda", torch.cuda.current_device())
dist.init_process_group("nccl")

partitions: list[list[list[int]]] = []
if args.groups_of:
    rows = [list(range(start, start + args.groups_of)) for start in range(0, world, args.groups_of)]
    partitions = [rows, [list(column) for column in zip(*rows, strict=True)]]
sub_groups: list[dict[int, dist.ProcessGroup]] = []  # each rank's group in each partition
for partition in partitions:
    made = [(members, dist.new_group(members)) for members in partition]
    sub_groups.append({r: group for members, group in made for r in members})

torch.manual_seed(1234 + (rank if args.different or args.seed_per_rank else 0))
layers: list[nn.Module] = []
for _ in range(args.layers):
    layers += [nn.Linear(args.width, args.width), nn.Tanh()]
net = nn.Sequential(*layers, nn.Linear(args.width, 4)).to(device)
model: nn.Module = net if args.different else DistributedDataParallel(net, device_ids=[device.index])
if args.seed_per_rank:
    time.sleep(3.0)  # nanoGPT evaluates before its first step: no collective meanwhile
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
generator = torch.Generator().manual_seed(77 + rank)

for step in range(args.steps):
    optimizer.zero_grad()
    x = torch.randn(8, args.width, generator=generator).to(device)
    y = torch.randint(0, 4, (8,), generator=generator).to(device)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    if args.different:
        shared = loss.detach().clone()
        dist.all_reduce(shared, group=sub_groups[step % 2][rank] if sub_groups else None)
        print(f"rank {rank} step {step} loss {loss.item():.10f} sum {shared.item():.10f}", flush=True)
    else:
        print(f"rank {rank} step {step} loss {loss.item():.10f}", flush=True)
    if args.sleep:
        time.sleep(args.sleep)

dist.barrier()
print(f"rank {rank} trained", flush=True)
if args.ready:
    open(f"{args.ready}{rank}", "w").close()
while args.hold and not os.path.exists(args.hold):
    time.sleep(0.05)
print(f"rank {rank} final {checksum(net)}", flush=True)
dist.destroy_process_group()
