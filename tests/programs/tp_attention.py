"""Tensor-parallel causal self-attention (pytorch/examples' tensor_parallelism pattern), torchrun-style.

q, k and v are split by heads over the ranks (`ColwiseParallel`), the output projection joins them
(`RowwiseParallel`), and `scaled_dot_product_attention(is_causal=True)` runs on DTensors sharded on
the heads; `.cuda()` moves the parallelized model (already there) and a DTensor whose parts are on
the host (as FSDP2's CPU offloading keeps them) to the device. Every rank prints its loss per
step. `--plain` runs the same model unsharded in one process (on the CPU with `--device cpu`), for
comparison: the losses agree to rounding.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--device", default="cuda")
parser.add_argument("--plain", action="store_true", help="one process, no tensor parallelism")
args = parser.parse_args()

HEADS, DIM, SEQ, BATCH = 4, 32, 12, 3


class Attention(nn.Module):
    """Causal multi-head self-attention."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (
            w(x).view(batch, seq, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


torch.manual_seed(3)
model = Attention()
rank = 0
if args.plain:
    device = torch.device(args.device)
else:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device())
    mesh = init_device_mesh("cuda", (world,))
    plan = {
        "wq": ColwiseParallel(),
        "wk": ColwiseParallel(),
        "wv": ColwiseParallel(),
        "wo": RowwiseParallel(),
    }
    model = parallelize_module(model.to(device), mesh, plan).cuda()  # DTensors already there
    host_mesh = init_device_mesh("cpu", (world,))
    offloaded = distribute_tensor(torch.arange(8.0), host_mesh, [Shard(0)])  # as FSDP2's CPU offload keeps it
    print(f"rank {rank} moved {offloaded.cuda().to_local().tolist()} {offloaded.to(device).device}")
model = model.to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
for step in range(args.steps):
    torch.manual_seed(100 + step)
    x = torch.randn(BATCH, SEQ, DIM).to(device)
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"rank {rank} step {step} loss {loss.item():.8f}", flush=True)
if not args.plain:
    dist.destroy_process_group()
