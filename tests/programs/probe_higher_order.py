"""Higher-order operators run eagerly on a device: flex_attention (plain, with a score_mod, with a
block mask, as transformers' `attn_implementation="flex_attention"` calls it for inference; the
CPU has no backward for it) and control flow (`torch.cond`, `while_loop`, `map`); digests of the
bytes printed."""

import hashlib
import sys
import warnings

import torch
from torch._higher_order_ops import map as map_over
from torch._higher_order_ops import while_loop
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

warnings.filterwarnings("ignore")
device = sys.argv[1]


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


generator = torch.Generator().manual_seed(0)
query, key, value = (torch.randn(1, 2, 16, 8, generator=generator).to(device) for _ in range(3))
causal = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 16, 16, device=device)
attentions = {
    "plain": lambda: flex_attention(query, key, value),
    "score_mod": lambda: flex_attention(query, key, value, score_mod=lambda s, b, h, q, kv: s + (q - kv)),
    "block_mask": lambda: flex_attention(query, key, value, block_mask=causal),
}
for name, attend in attentions.items():
    print(name, digest(attend()))
x = torch.arange(6.0, device=device)
print("cond", torch.cond(x.sum() > 3, lambda a: a * 2, lambda a: a - 1, (x,)).tolist())
start = torch.tensor(0, device=device)
counter, doubled = while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a * 2), (start, x))
print("while_loop", counter.item(), doubled.tolist())
print("map", map_over(lambda a: a * 3, x.reshape(2, 3)).tolist())
