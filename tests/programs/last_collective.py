"""Rank 1 ends right after queueing its last all_reduce, without waiting for it; rank 0 reads the
result only after that (launched torchrun-style, 2 ranks). On a GPU the collective completes: the
work a process launched is finished even when the process ends first. Prints rank 0's result."""

import os
import time

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
dist.init_process_group("nccl")
values = torch.full((4,), float(rank + 1), device="cuda")
dist.all_reduce(values)
if rank == 1:
    dist.destroy_process_group()
    raise SystemExit(0)
time.sleep(2)
print("rank 0 sum", values.tolist(), flush=True)
dist.destroy_process_group()
