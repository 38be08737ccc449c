"""Writes its cuda tensors in every way a device proxy must notice, until a file appears.

For the pre-copy tests: a large tensor that is only read (its pre-copy stays good), a large
tensor written in small parts, and a pool of tensors written in place, through views, through
`out=`, by copies from the host (small fills and chunked uploads), through `set_` aliases,
replaced, detached, and trained with an optimizer's foreach updates.
Usage: mutator.py HOLD_FILE [SEED]
"""

from __future__ import annotations

import os
import random
import sys

import torch

hold = sys.argv[1]
rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
torch.manual_seed(0)
device = os.environ.get("MUTATOR_DEVICE", "cuda")
static = torch.ones(16 << 20, device=device)  # 64 MiB, read only
hot = torch.zeros(8 << 20, device=device)  # 32 MiB, written a little at a time
params = [torch.randn(128, 128, device=device, requires_grad=True) for _ in range(4)]
optimizer = torch.optim.Adam(params, lr=0.01, fused=True)  # a kernel that leaves version counters be
pool = {i: torch.randn(1000 + i, device=device) for i in range(8)}


def mutate(kind: int, a: int, b: int) -> None:
    """One write of the given kind to the pool's tensors a and b (or the large ones)."""
    x, y = pool[a], pool[b]
    if kind == 0:
        hot[rng.randrange(hot.numel())].add_(1.0)
    elif kind == 1:
        torch.add(x[: min(len(x), len(y))], 1.0, out=y[: min(len(x), len(y))])
    elif kind == 2:
        x.view(-1)[::3].mul_(1.5)
    elif kind == 3:
        x.copy_(torch.randn(x.shape))
    elif kind == 4:
        pool[a] = torch.randn(rng.randrange(100, 5000), device=device)
    elif kind == 5 and rng.random() < 0.1:
        pool[a] = torch.randn(9 << 20).to(device)  # 36 MiB: allocated, then written in chunks
    elif kind == 6:
        alias = torch.empty_like(y)
        alias.set_(y)  # another tensor over y's storage, with a version counter of its own
        alias.add_(2.0)
        pool[a] = alias
    elif kind == 7:
        x.detach().add_(3.0)
    elif kind == 8:
        loss = sum((p * p).sum() for p in params)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    elif kind == 9:
        x.masked_fill_(x > 0.5, 0.25)
    elif kind == 10:
        hot.view(-1, 1024)[rng.randrange(hot.numel() // 1024)].fill_(rng.random())
    elif kind == 11:
        x.index_add_(0, torch.tensor([0, 1], device=device), torch.ones(2, device=device))


steps = 0
print("ready", flush=True)
while not os.path.exists(hold):
    mutate(rng.randrange(12), rng.randrange(len(pool)), rng.randrange(len(pool)))
    steps += 1
    if steps % 8 == 0:
        static.sum().item()
print("steps", steps > 0, float(static.sum().item()))
