"""FSDP1 (`FullyShardedDataParallel`) the way Lightning, accelerate and older recipes use it, and
DDP resuming from saved weights, launched torchrun-style (RANK etc.).

FSDP1 wraps a host-built model given `device_id` (it moves the parameters itself), shards each
block fully with bf16 mixed precision, clips by norm, gathers the full weights with
`summon_full_params` and saves a full state dict on rank 0. Then a DDP model loads weights saved
before training into `ddp.module` (a resume after wrapping), trains on, and loads them again.
Every rank prints its losses and checksums; `--device cpu` runs it directly with gloo.
"""

import argparse
import functools
import hashlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--device", default="cuda", help="cuda (backend nccl), or cpu (backend gloo)")
args = parser.parse_args()

rank = int(os.environ["RANK"])
if args.device == "cuda":
    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
else:
    device = torch.device("cpu")
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(24, 24)
        self.norm = nn.LayerNorm(24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.linear(x)))


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 24), Block(), Block(), nn.Linear(24, 3))
model = FSDP(
    model,  # on the host: FSDP moves it to device_id
    device_id=device,
    sharding_strategy=ShardingStrategy.FULL_SHARD,
    auto_wrap_policy=functools.partial(ModuleWrapPolicy({Block})),
    mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.Generator().manual_seed(10 + rank)
for step in range(args.steps):
    x, y = torch.randn(8, 10, generator=data).to(device), torch.randint(0, 3, (8,), generator=data).to(device)
    loss = nn.functional.cross_entropy(model(x).float(), y)
    optimizer.zero_grad()
    loss.backward()
    norm = model.clip_grad_norm_(0.5)
    optimizer.step()
    print(f"rank {rank} fsdp step {step} loss {loss.item()!r} norm {norm.item()!r}", flush=True)
with FSDP.summon_full_params(model, writeback=False):
    print(f"rank {rank} summoned {sum(p.double().sum().item() for p in model.parameters())!r}", flush=True)
config = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
    state = model.state_dict()
if rank == 0:
    print("rank 0 full state", [f"{name} {digest(value)}" for name, value in sorted(state.items())])

torch.manual_seed(1)
net = nn.Linear(6, 2).to(device)
saved = {name: value.clone() for name, value in net.state_dict().items()}
ddp = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
ddp.module.load_state_dict(saved)  # resuming after wrapping: the reducer holds the parameters
sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
for step in range(2):
    loss = ddp(torch.randn(4, 6, generator=data).to(device)).square().mean()
    sgd.zero_grad()
    loss.backward()
    sgd.step()
    print(f"rank {rank} ddp step {step} loss {loss.item()!r}", flush=True)
ddp.module.load_state_dict(saved)
same = torch.equal(net.weight.cpu(), saved["weight"].cpu())
print(f"rank {rank} reloaded {digest(net.weight)} {same}", flush=True)
dist.destroy_process_group()
