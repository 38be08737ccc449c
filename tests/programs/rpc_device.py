"""Functions that torch.distributed.rpc runs for another process use the device, as on a GPU: RPC
runs them on threads it starts in C++. Worker 0 uses the device; worker 1 never does, and asks
worker 0 to run them (worker 0 asks itself too)."""

import os
import sys

import torch
import torch.distributed.rpc as rpc
from _common import spawn_on_a_free_port


def on_device(device: str, n: int) -> str:
    torch.manual_seed(n)
    layer = torch.nn.Linear(n, 2).to(device)
    made = torch.ones(n, device=device)
    there = layer.weight.device.type == device
    return f"{there} {float(layer(made).sum().detach()):.6f} {float(made.sum())}"


def run(rank: int, device: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
    if rank == 0:
        print("w0 here:", on_device(device, 3), flush=True)
        print("w0 asks itself:", rpc.rpc_sync("w0", on_device, args=(device, 4)), flush=True)
    rpc.api._barrier(["w0", "w1"])
    if rank == 1:
        print("w1 asks w0:", rpc.rpc_sync("w0", on_device, args=(device, 5)), flush=True)
        remote = rpc.remote("w0", on_device, args=(device, 6))
        print("w1 remote on w0:", remote.to_here(), flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    spawn_on_a_free_port(run, sys.argv[1])
