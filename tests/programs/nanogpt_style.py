"""A small GPT trained the way karpathy/nanoGPT's train.py does it (our own code, same habits).

It detects a torchrun launch by RANK, then asks for nccl, picks cuda:LOCAL_RANK, wraps the model
in DDP, accumulates gradients with `require_backward_grad_sync`, clips, scales (GradScaler),
evaluates every few iterations under no_grad, and prints from the master process only. Settings
are module globals overridden by `--name=value` arguments, as nanoGPT's configurator does.
With --hold=FILE the master waits, before its last line, until FILE exists.
"""

import math
import os
import sys
import time
from contextlib import nullcontext

import torch
from torch import nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# -- settings (overridable as --name=value) ------------------------------------------------------
max_iters = 30
eval_interval = 10
eval_iters = 2
gradient_accumulation_steps = 4
batch_size = 4
block_size = 32
n_layer = 2
n_head = 2
n_embd = 64
vocab_size = 96
learning_rate = 1e-3
grad_clip = 1.0
device = "cuda"
dtype = "float32"
hold = ""
for argument in sys.argv[1:]:
    key, _, value = argument.removeprefix("--").partition("=")
    current = globals()[key]
    globals()[key] = type(current)(value) if not isinstance(current, bool) else value == "True"

# -- distributed set-up, as nanoGPT does it ------------------------------------------------------
ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend="nccl")
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    device = f"cuda:{ddp_local_rank}"
    torch.cuda.set_device(device)
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process = True
    seed_offset = 0
    ddp_world_size = 1
torch.manual_seed(1337 + seed_offset)
device_type = "cuda" if "cuda" in device else "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

# -- data: a fixed token stream (nanoGPT reads train.bin; this makes one) ------------------------
stream = torch.Generator().manual_seed(7)
train_data = torch.randint(0, vocab_size, (20000,), generator=stream)
val_data = torch.randint(0, vocab_size, (4000,), generator=stream)


def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    data = train_data if split == "train" else val_data
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i : i + block_size] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix])
    if device_type == "cuda":
        x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    else:
        x, y = x.to(device), y.to(device)
    return x, y


# -- the model -----------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


model = GPT().to(device)
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95))
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank])
raw_model = model.module if ddp else model


@torch.no_grad()
def estimate_loss() -> dict[str, float]:
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                losses[k] = model(X, Y).item()
        out[split] = losses.mean().item()
    model.train()
    return out


X, Y = get_batch("train")
t0 = time.time()
for iter_num in range(max_iters + 1):
    lr = learning_rate * 0.5 * (1 + math.cos(math.pi * iter_num / max_iters))
    for group in optimizer.param_groups:
        group["lr"] = lr
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", flush=True)
    if iter_num == max_iters:
        break
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with ctx:
            loss = model(X, Y) / gradient_accumulation_steps
        X, Y = get_batch("train")
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if master_process:
        print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.6f}", flush=True)

while hold and not os.path.exists(hold):
    time.sleep(0.05)
if master_process:
    digest = sum(float(p.double().sum()) for p in raw_model.parameters())
    print(f"done in {ddp_world_size} process(es), weight sum {digest:.10f}", flush=True)
if ddp:
    destroy_process_group()
