"""torch.distributed.pipelining's own schedules (GPipe, 1F1B) over one stage per rank, launched
torchrun-style: the library's point-to-point messages (batch_isend_irecv of activations and
gradients per micro-batch) as a pipeline-parallel program uses them. The last rank prints each
step's micro-batch losses, every rank its stage's weight sum. `--device cpu` runs it with gloo.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cuda")
parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
parser.add_argument("--steps", type=int, default=3)
options = parser.parse_args()

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if options.device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl")
else:
    device = torch.device("cpu")
    dist.init_process_group("gloo")
torch.manual_seed(rank)
module = nn.Sequential(nn.Linear(16, 16), nn.ReLU()).to(device)
stage = PipelineStage(module, rank, world, device)
kind = ScheduleGPipe if options.schedule == "gpipe" else Schedule1F1B
schedule = kind(stage, n_microbatches=4, loss_fn=lambda out, target: ((out - target) ** 2).mean())
optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
data = torch.Generator().manual_seed(0)
for step in range(options.steps):
    x, y = torch.randn(8, 16, generator=data).to(device), torch.randn(8, 16, generator=data).to(device)
    losses: list[torch.Tensor] = []
    if rank == 0:
        schedule.step(x)
    elif rank == world - 1:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    optimizer.step()
    optimizer.zero_grad()
    if rank == world - 1:
        print(f"rank {rank} step {step} losses {[loss.item() for loss in losses]}", flush=True)
print(f"rank {rank} weight sum {module[0].weight.double().sum().item()!r}", flush=True)
dist.destroy_process_group()
