"""Sharded data-parallel training with FSDP2 (`fully_shard`), launched torchrun-style (RANK etc.).

Each block and the whole model are sharded over the ranks; every rank prints its loss per step
and, at the end, a checksum of the full (gathered) weights. `--device cpu` runs it directly with
gloo, for comparison. With `--meta-init` the model is built on the meta device, sharded, moved to
its device empty (`to_empty`) and given the same initial weights as the other runs, shard by shard;
with `--meta-init --reset-init` each module's `reset_parameters()` draws them instead, as
pytorch/examples' FSDP2 example does (DTensor's random operators, each rank its own shard), and
the final weights are gathered by `get_model_state_dict` to the host, as that example saves them.
"""

import argparse
import hashlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--device", default="cuda", help="cuda (backend nccl), or cpu (backend gloo)")
parser.add_argument("--meta-init", action="store_true", help="build on the meta device, then to_empty")
parser.add_argument("--reset-init", action="store_true", help="with --meta-init: reset_parameters() draws")
args = parser.parse_args()

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if args.device == "cuda":
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
else:
    device = torch.device("cpu")
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def build() -> nn.Module:
    """Three blocks and a head."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(48, 48), nn.GELU()) for _ in range(3)], nn.Linear(48, 6))


torch.manual_seed(5)
if args.meta_init:
    initial = build().state_dict()
    with torch.device("meta"):
        model = build()
else:
    model = build().to(device)
for block in model[:3]:
    fully_shard(block)
fully_shard(model)
if args.meta_init:
    model.to_empty(device=device)
if args.meta_init and args.reset_init:
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()
elif args.meta_init:
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            mesh, placements = parameter.device_mesh, parameter.placements
            parameter.copy_(distribute_tensor(initial[name].to(device), mesh, placements))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
generator = torch.Generator().manual_seed(300 + rank)
for step in range(args.steps):
    x = torch.randn(12, 48, generator=generator).to(device)
    y = torch.randint(0, 6, (12,), generator=generator).to(device)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"rank {rank} step {step} loss {loss.item():.10f}", flush=True)

assert all(parameter.device == device for parameter in model.parameters()), (
    "a DTensor is where its shards are"
)
if args.reset_init:  # as pytorch/examples' FSDP2 example saves it
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_weights = get_model_state_dict(model, options=options)
else:
    full_weights = {
        name: parameter.full_tensor().detach().cpu() for name, parameter in model.named_parameters()
    }
digest = hashlib.sha256()
for name, full in full_weights.items():
    digest.update(name.encode() + full.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
print(f"rank {rank} final {digest.hexdigest()[:32]}", flush=True)
dist.destroy_process_group()
