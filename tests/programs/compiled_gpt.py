"""A small nanoGPT-style language model trained with torch.compile, as nanoGPT's train.py does.

Causal self-attention through scaled_dot_product_attention, GELU MLP, LayerNorm, weight tying,
AdamW with fused=False, gradient clipping; `--compile 1` wraps the model in torch.compile.
Prints every loss and a checksum of the weights.
"""

import argparse
import math

import torch
from _common import checksum
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.size()
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(batch, length, width))


class Block(nn.Module):
    """LayerNorm, attention, LayerNorm, MLP, with residuals."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token and position embeddings, blocks, tied output head."""

    def __init__(self, vocab: int, length: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(length, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--compile", type=int, default=1)
parser.add_argument("--steps", type=int, default=8)
args = parser.parse_args()

torch.manual_seed(1337)
model = GPT(vocab=65, length=16, width=32, layers=2, heads=4).to(args.device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=False)
if args.compile:
    model = torch.compile(model)
data = torch.randint(0, 65, (4096,))
for step in range(args.steps):
    starts = torch.randint(len(data) - 17, (8,))
    x = torch.stack([data[i : i + 16] for i in starts]).to(args.device)
    y = torch.stack([data[i + 1 : i + 17] for i in starts]).to(args.device)
    loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {step} loss {loss.item()!r}")
print("final", checksum(getattr(model, "_orig_mod", model)))
