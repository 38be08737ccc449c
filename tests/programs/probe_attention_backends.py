"""Attention with only the GPU's kernels allowed (memory-efficient, cuDNN): on a device it runs
the host's default kernel, so it prints what the host computes with every backend allowed."""

import contextlib
import hashlib
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

device = sys.argv[1]


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


@contextlib.contextmanager
def flash_and_math_off() -> Any:
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_math_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
        torch.backends.cuda.enable_math_sdp(True)


selections: dict[str, Callable[[], Any]] = {
    "efficient": lambda: sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION),
    "cudnn": lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION),
    "efficient or cudnn": lambda: sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]),
    "flash and math off": flash_and_math_off,
}
torch.manual_seed(0)
query, key, value = (torch.randn(2, 4, 8, 16, device=device, requires_grad=True) for _ in range(3))
mask = torch.rand(8, 8, device=device) > 0.3
for name, selection in selections.items():
    with selection() if device != "cpu" else contextlib.nullcontext():
        causal = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        masked = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
        (causal.sum() + masked.square().sum()).backward()
    assert query.grad is not None
    print(name, digest(causal), digest(masked), digest(query.grad))
    query.grad = None
print("flags back", torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())
