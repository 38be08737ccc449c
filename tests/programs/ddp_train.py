"""Data-parallel training with DistributedDataParallel, launched torchrun-style (RANK etc.).

Every rank prints its loss at each step and, at the end, a checksum of its weights. The options
exercise what DDP offers: a communication hook, gradient accumulation under `no_sync`,
`find_unused_parameters` (with a branch used every other step), `gradient_as_bucket_view`, small
buckets (several allreduces per step). `--device cpu` runs it directly with gloo, for comparison.
With --hold FILE every rank waits, before its checksum, until FILE exists (a test's signal to end).
With --gate STEP:FILE (repeatable) every rank waits before that step until FILE exists, so a test
can change the job's devices at a known point of its training.
With --rank0-reads only rank 0 reads its loss and weights and waits (gates, hold), as nanoGPT's master
process alone logs: the other ranks never wait for anything, so they queue all their work and end
while much of it is still to run.
With --die-once RANK:STEP that rank kills itself once as it starts that step, when the test says
(files in its working directory; a rank restored from a checkpoint finds it died before).
"""

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from _common import checksum
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--device", default="cuda", help="cuda (backend nccl), or cpu (backend gloo)")
parser.add_argument("--backend", default="", help="what to ask init_process_group for (default: per device)")
parser.add_argument("--hook", choices=["", "allreduce", "fp16"], default="")
parser.add_argument(
    "--accumulate", type=int, default=1, help="micro-batches per step (no_sync on all but the last)"
)
parser.add_argument(
    "--unused", action="store_true", help="find_unused_parameters, with a branch used every other step"
)
parser.add_argument("--bucket-view", action="store_true", help="gradient_as_bucket_view")
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--hold", help="before the checksum, wait until this file exists")
parser.add_argument(
    "--gate", action="append", default=[], help="STEP:FILE: before that step, wait until FILE exists"
)
parser.add_argument("--rank0-reads", action="store_true", help="only rank 0 reads values, prints and waits")
parser.add_argument("--crash", help="RANK:STEP: that rank dies (exit 3) as it starts that step")
parser.add_argument("--die-once", help="RANK:STEP: that rank is killed (SIGKILL) once, see die_once")
args = parser.parse_args()


def die_once() -> None:
    """Announce die-once.waiting, wait for die-once.go, then die by SIGKILL leaving die-once.died;
    a rank that finds die-once.died (restored after its death) goes on."""
    if os.path.exists("die-once.died"):
        return
    open("die-once.waiting", "w").close()
    while not os.path.exists("die-once.go"):
        time.sleep(0.05)
    if not os.path.exists("die-once.died"):
        open("die-once.died", "w").close()
        os.kill(os.getpid(), signal.SIGKILL)


rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
local = int(os.environ.get("LOCAL_RANK", rank))
if args.device == "cuda":
    torch.cuda.set_device(local % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
else:
    device = torch.device("cpu")
dist.init_process_group(args.backend or ("nccl" if device.type == "cuda" else "gloo"))


class Net(nn.Module):
    """Two hidden layers and a side branch that only some steps use."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.side = nn.Linear(64, 64)
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        h = self.body(x)
        if use_side:
            h = h + torch.relu(self.side(h))
        return self.head(h)


torch.manual_seed(1234)
net = Net().to(device)
model = DistributedDataParallel(
    net,
    device_ids=[device.index] if device.type == "cuda" else None,
    bucket_cap_mb=0.01,
    find_unused_parameters=args.unused,
    gradient_as_bucket_view=args.bucket_view,
)
if args.hook == "allreduce":
    model.register_comm_hook(None, default_hooks.allreduce_hook)
elif args.hook == "fp16":
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
generator = torch.Generator().manual_seed(77 + rank)
inputs = torch.randn(256, 32, generator=generator)
labels = torch.randint(0, 4, (256,), generator=generator)

crash_rank, _, crash_step = (args.crash or "-1:-1").partition(":")
die_rank, _, die_step = (args.die_once or "-1:-1").partition(":")
gates = {int(step): path for step, _, path in (gate.partition(":") for gate in args.gate)}
reads = rank == 0 or not args.rank0_reads
for step in range(args.steps):
    while step in gates and reads and not os.path.exists(gates[step]):
        time.sleep(0.05)
    if rank == int(die_rank) and step == int(die_step):
        die_once()
    if rank == int(crash_rank) and step == int(crash_step):
        print(f"rank {rank} crashes at step {step}", flush=True)
        os._exit(3)
    optimizer.zero_grad()
    use_side = not args.unused or step % 2 == 0
    total = 0.0
    for micro in range(args.accumulate):
        index = torch.randint(0, 256, (16,), generator=generator)
        x, y = inputs[index].to(device), labels[index].to(device)
        if micro < args.accumulate - 1:
            with model.no_sync():
                loss = nn.functional.cross_entropy(model(x, use_side), y)
                loss.backward()
        else:
            loss = nn.functional.cross_entropy(model(x, use_side), y)
            loss.backward()
        if reads:
            total += loss.item()
    optimizer.step()
    if reads:
        print(f"rank {rank} step {step} loss {total:.10f}", flush=True)
    if args.sleep:
        time.sleep(args.sleep)

while reads and args.hold and not os.path.exists(args.hold):
    time.sleep(0.05)
if reads:
    print(f"rank {rank} final {checksum(net)}", flush=True)
dist.destroy_process_group()
