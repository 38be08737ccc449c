"""Pipeline training over torch.distributed.rpc, as pytorch/examples' rpc/pipeline does it: worker
1 holds a model on the device and answers micro-batches concurrently (`rpc_async`), each answer
copied to the host; the master's distributed autograd then runs their backward passes on several
threads at once, each copying a gradient back to the device. Prints every step's loss.

Usage: rpc_pipeline.py [DEVICE] [--steps N] [--sleep SECONDS] [--hold FILE]: with --hold the
master waits, before its last step, until FILE exists."""

import argparse
import os
import threading
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from _common import hold, spawn_on_a_free_port
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef

MICRO_BATCHES = 8


class Stage(torch.nn.Module):
    """The device's part of the model, shared by the RPC threads that run its micro-batches."""

    def __init__(self, device: str) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.device = device
        layers = [torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)]
        self.net = torch.nn.Sequential(*layers).to(device)
        self.lock = threading.Lock()

    def forward(self, x_rref: RRef) -> torch.Tensor:
        x = x_rref.to_here().to(self.device)
        with self.lock:
            out = self.net(x)
        return out.cpu()

    def parameter_rrefs(self) -> list[RRef]:
        return [RRef(p) for p in self.parameters()]


def parsed() -> argparse.Namespace:
    """The command line (the device defaults to cuda where there is one)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("device", nargs="?", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds the master rests after each step")
    ap.add_argument("--hold", help="before the last step, wait until this file exists")
    return ap.parse_args()


def run(rank: int, device: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        stage = rpc.remote("w1", Stage, args=(device,))
        optimizer = DistributedOptimizer(torch.optim.SGD, stage.rpc_sync().parameter_rrefs(), lr=0.05)
        torch.manual_seed(2)
        args = parsed()
        for step in range(args.steps):
            if step == args.steps - 1:
                hold(args.hold)
            inputs, targets = torch.randn(64, 32), torch.randn(64, 4)
            with dist_autograd.context() as context:
                answers = [stage.rpc_async().forward(RRef(part)) for part in inputs.chunk(MICRO_BATCHES)]
                outputs = torch.cat(torch.futures.wait_all(answers))
                loss = torch.nn.functional.mse_loss(outputs, targets)
                dist_autograd.backward(context, [loss])
                optimizer.step(context)
            print(f"step {step} loss {loss.item():.6f}", flush=True)
            time.sleep(args.sleep)
    rpc.shutdown()


if __name__ == "__main__":
    spawn_on_a_free_port(run, parsed().device)
