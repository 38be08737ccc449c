# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""torch's inference fast paths, taken for stand-ins as for a GPU's tensors.

`nn.TransformerEncoderLayer` and `nn.MultiheadAttention` in eval mode without gradients run one
fused kernel (`torch._transformer_encoder_layer_fwd`, `torch._native_multi_head_attention`) on
the CPU and on GPUs, unless `torch.overrides.has_torch_function` says an argument or a mode
overrides torch functions. The device mode is always active in a job, so they took the slow path
there and their outputs differed from a direct run's in the low bits. Those two checks now ignore
the device mode and stand-ins; the fused kernel then runs on the server like any operator.
`nn.TransformerEncoder` keeps its own check: its fast path packs padded batches into nested
tensors, which the devices do not serve.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch

from .mode import DeviceMode
from .tensor import ProxyTensor

_HAS_TORCH_FUNCTION = torch.overrides.has_torch_function
_PLAIN = (torch.Tensor, torch.nn.Parameter, ProxyTensor)
_CHECKS: set[Any] = set()
"""The code of the functions whose `has_torch_function` question decides a fast path."""


def _has_torch_function(args: Iterable[Any]) -> bool:
    """`torch.overrides.has_torch_function`, answering a fast path's check as a direct run does:
    no when the only overrides are the device mode's and the stand-ins' own."""
    if (
        sys._getframe(1).f_code in _CHECKS
        and all(arg is None or type(arg) in _PLAIN for arg in args)
        and all(isinstance(mode, DeviceMode) for mode in torch.overrides._get_current_function_mode_stack())
    ):
        return False
    return _HAS_TORCH_FUNCTION(args)


def install() -> None:
    """Answer the fast paths' checks of `has_torch_function` as a direct run does."""
    _CHECKS.update(
        {torch.nn.TransformerEncoderLayer.forward.__code__, torch.nn.MultiheadAttention.forward.__code__}
    )
    torch.overrides.has_torch_function = _has_torch_function
