# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""torch's inference fast paths, taken for stand-ins as for a GPU's tensors.

`nn.TransformerEncoderLayer` and `nn.MultiheadAttention` in eval mode without gradients run one
fused kernel (`torch._transformer_encoder_layer_fwd`, `torch._native_multi_head_attention`) on
the CPU and on GPUs, unless `torch.overrides.has_torch_function` says an argument or a mode
overrides torch functions. The device mode is always active in a job, so they took the slow path
there and their outputs differed from a direct run's in the low bits. Those two checks now ignore
the device mode and stand-ins; the fused kernel then runs on the server like any operator.
`nn.TransformerEncoder`'s check, asked only when a padding mask is given, is answered the same
way: its fast path packs the batch into a nested tensor, runs the layers on it and pads the
result. The devices serve no nested tensors, so that packing gives a `NestedStandIn`, which
collects the layers' fused calls; padding it runs the whole chain on the server in one operator
(encoder_operator.py).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from . import encoder_operator
from .channel import CLIENT_LOCK
from .mode import DeviceMode
from .tensor import HOST, ProxyTensor, forward, special_ops

aten = torch.ops.aten
_HAS_TORCH_FUNCTION = torch.overrides.has_torch_function
_CHECKS: set[Any] = set()
"""The code of the functions whose `has_torch_function` question decides a fast path."""


class NestedStandIn(torch.Tensor):
    """The nested tensor `torch._nested_tensor_from_mask(src, keep)` makes of stand-ins, followed
    by the fused encoder layers run on it so far: nothing is computed until it is padded again."""

    _src: ProxyTensor
    _keep: ProxyTensor
    _mask_check: bool
    _layers: tuple[tuple[Any, ...], ...]  # each layer call's arguments after its input

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(
        cls, src: ProxyTensor, keep: ProxyTensor, mask_check: bool, layers: tuple[tuple[Any, ...], ...]
    ) -> NestedStandIn:
        nested = torch.Tensor._make_wrapper_subclass(cls, src.shape, dtype=src.dtype, device=HOST)
        nested._src, nested._keep, nested._mask_check, nested._layers = src, keep, mask_check, layers
        return nested  # type: ignore[no-any-return]

    @property  # type: ignore[misc]
    def device(self) -> torch.device:  # type: ignore[override]
        return self._src.device

    @property  # type: ignore[misc]
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property  # type: ignore[misc]
    def is_nested(self) -> bool:  # type: ignore[override]
        return True

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"nested_tensor(<{len(self._layers)} encoder layers pending>, device='{self.device}')"

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        nested = args[0] if args else None
        arguments = [*args[1:], *(kwargs or {}).values()]
        if type(nested) is cls and not any(type(arg) is cls for arg in arguments):
            if func is aten._transformer_encoder_layer_fwd.default and _unmasked(args, kwargs or {}):
                layers = (*nested._layers, tuple(args[1:18]))
                return cls(nested._src, nested._keep, nested._mask_check, layers)
            if func is aten.to_padded_tensor.default:
                return nested._padded(*args[1:], **(kwargs or {}))
        raise NotImplementedError(
            f"proxy: {func} is not run on proxied devices for a nested tensor: the devices serve "
            "nested tensors only within nn.TransformerEncoder's fast path"
        )

    def _padded(self, padding: float, output_size: Sequence[int] | None = None) -> ProxyTensor:
        """The chain run on the server: packed, through each layer, padded."""
        weights: list[Any] = []
        options: list[int] = []
        eps: list[float] = []
        for layer in self._layers:
            embed_dim, num_heads, qkv_w, qkv_b, proj_w, proj_b, use_gelu, norm_first, layer_eps = layer[:9]
            weights += [qkv_w, qkv_b, proj_w, proj_b, *layer[9:17]]
            options += [embed_dim, num_heads, int(use_gelu), int(norm_first)]
            eps.append(layer_eps)
        size = None if output_size is None else list(output_size)
        operator = encoder_operator.define()
        arguments = (self._src, self._keep, self._mask_check, weights, options, eps, padding, size)
        with CLIENT_LOCK:
            return forward(operator, arguments, None)  # type: ignore[no-any-return]


def _unmasked(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a fused layer call has neither a mask nor a mask type (as on a nested input)."""
    extra = [*args[18:], *kwargs.values()]
    return len(args) >= 18 and all(value is None for value in extra)


def _nested_from_mask(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`torch._nested_tensor_from_mask` of stand-ins: a NestedStandIn, computed when padded."""
    src, keep = args[0], args[1]
    mask_check = bool(args[2] if len(args) > 2 else kwargs.get("mask_check", True))
    if type(src) is not ProxyTensor or type(keep) is not ProxyTensor:
        return forward(func, args, kwargs)
    return NestedStandIn(src, keep, mask_check, ())


_PLAIN = (torch.Tensor, torch.nn.Parameter, ProxyTensor, NestedStandIn)


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
        {
            torch.nn.TransformerEncoder.forward.__code__,
            torch.nn.TransformerEncoderLayer.forward.__code__,
            torch.nn.MultiheadAttention.forward.__code__,
        }
    )
    torch.overrides.has_torch_function = _has_torch_function
    special_ops[aten._nested_tensor_from_mask.default] = _nested_from_mask
