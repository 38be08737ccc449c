"""A collective with a root (broadcast, scatter, gather or reduce) that rank 1 reaches late:
before step `--late-at` it waits until the file `--late-until` exists, while rank 0 goes on to
the collective at once (launched torchrun-style, 2 ranks). Rank 1 is the one that needs data
from rank 0 or the root that needs rank 0's part, so rank 0's side of the collective needs
nothing from rank 1. Each rank prints its values after every step; an all_reduce ends each step.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--kind", choices=["broadcast", "scatter", "gather", "reduce"], required=True)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--late-at", type=int, default=2)
parser.add_argument("--late-until", help="rank 1 waits for this file before step --late-at")
args = parser.parse_args()

rank = int(os.environ["RANK"])
torch.cuda.set_device(rank % torch.cuda.device_count())
dist.init_process_group("nccl")
root = 0 if args.kind in ("broadcast", "scatter") else 1
values = torch.arange(4.0, device="cuda") + 10 * rank
for step in range(args.steps):
    if step == args.late_at:
        print(f"rank {rank} reaches step {step}", flush=True)
        while rank == 1 and args.late_until and not os.path.exists(args.late_until):
            time.sleep(0.05)
    if args.kind == "broadcast":
        dist.broadcast(values, src=root)
    elif args.kind == "scatter":
        received = torch.empty_like(values)
        dist.scatter(received, [values * (i + 2) for i in range(2)] if rank == root else None, src=root)
        values = received
    elif args.kind == "gather":
        parts = [torch.empty_like(values) for _ in range(2)] if rank == root else None
        dist.gather(values, parts, dst=root)
        if parts is not None:
            values = parts[0] * 3 - parts[1]
    else:
        dist.reduce(values, dst=root)
    values = values * 1.5 + rank
    dist.all_reduce(values)
    print(f"rank {rank} step {step} {values.tolist()}", flush=True)
dist.destroy_process_group()
