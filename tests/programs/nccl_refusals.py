"""What NCCL's process group refuses before it starts a collective on device tensors (a tensor
that is not dense in its memory format, a bitwise reduction, an average of booleans), each
refusal printed, and the same collectives on dense tensors carried out. Run with 2 ranks."""

import os

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
torch.cuda.set_device(rank % torch.cuda.device_count())
dist.init_process_group("nccl")
device = torch.device("cuda", torch.cuda.current_device())
base = torch.arange(12.0, device=device).reshape(3, 4) + 100 * rank
column = base[:, 1].contiguous()
received = torch.empty(4, 2, device=device).t()
attempts = {
    "all_reduce transposed": lambda: dist.all_reduce(base.t()),
    "broadcast column": lambda: dist.broadcast(base[:, 1], src=0),
    "reduce transposed": lambda: dist.reduce(base.t(), dst=0),
    "all_to_all_single transposed output": lambda: dist.all_to_all_single(
        torch.empty(4, 2, device=device).t(), base[:2]
    ),
    "scatter into a column": lambda: dist.scatter(
        base[:, 0], [base[:, 1].contiguous()] * 2 if rank == 0 else None
    ),
    "reduce_scatter into a column": lambda: dist.reduce_scatter(base[:, 0], [base[:, 1].contiguous()] * 2),
    "all_reduce band": lambda: dist.all_reduce(base.long(), op=dist.ReduceOp.BAND),
    "all_reduce avg of booleans": lambda: dist.all_reduce(base > 105, op=dist.ReduceOp.AVG),
}
for name, attempt in attempts.items():
    try:
        attempt()
        print(f"rank {rank} {name} ran", flush=True)
    except (ValueError, TypeError) as error:
        print(f"rank {rank} {name} {type(error).__name__}: {error}", flush=True)
channels_last = base.reshape(1, 3, 2, 2).to(memory_format=torch.channels_last).clone()
dist.all_reduce(channels_last)
dense = base.t().contiguous()
dist.all_reduce(dense)
print(f"rank {rank} dense {channels_last.flatten().tolist()} {dense.flatten().tolist()}", flush=True)
dist.destroy_process_group()
