"""A basic DDP demo in the style of pytorch/examples' distributed/ddp/example.py (our own code).

Launched torchrun-style, it prints how the process group was initialised, asks for the
accelerator's default backend, splits the visible devices between the local ranks, feeds host
inputs to the DDP model (DDP moves them to the device) and takes a few SGD steps, printing each
step's loss and the final weights' checksum. `--cpu` runs it directly with gloo, for comparison.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from _common import checksum
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(local_world_size, local_rank, cpu, steps):
    rank = dist.get_rank()
    if cpu:
        device_ids, model = None, ToyModel()
    else:
        n = max(1, torch.cuda.device_count() // local_world_size)
        first = (local_rank * n) % torch.cuda.device_count()
        device_ids = list(range(first, first + n))
        model = ToyModel().to(device_ids[0])  # Module.to with a bare index, as pytorch/examples does
    print(f"rank = {rank}, world_size = {dist.get_world_size()}, device_ids = {device_ids}", flush=True)
    ddp_model = DDP(model, device_ids)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    generator = torch.Generator().manual_seed(rank)
    for step in range(steps):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10, generator=generator))
        labels = torch.randn(20, 5, generator=generator)
        labels = labels if cpu else labels.to(device_ids[0])
        loss = loss_fn(outputs, labels)
        loss.backward()
        optimizer.step()
        print(f"rank {rank} step {step} loss {loss.item():.10f}", flush=True)
    print(f"rank {rank} final {checksum(model)}", flush=True)


def spmd_main(local_world_size, local_rank, cpu, steps):
    env_dict = {key: os.environ[key] for key in ("MASTER_ADDR", "RANK", "WORLD_SIZE")}
    print(f"Initializing process group with: {env_dict}", flush=True)
    if cpu:
        dist.init_process_group(backend="gloo")
    else:
        accelerator = torch.accelerator.current_accelerator()
        dist.init_process_group(backend=dist.get_default_backend_for_device(accelerator))
    print(f"world_size = {dist.get_world_size()}, rank = {dist.get_rank()}, backend={dist.get_backend()}")
    torch.manual_seed(0)
    demo_basic(local_world_size, local_rank, cpu, steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser.add_argument("--local_world_size", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    parser.add_argument("--cpu", action="store_true", help="run directly on the CPU with gloo")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    spmd_main(args.local_world_size, args.local_rank, args.cpu, args.steps)
