# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""Copies between the host and the proxied devices, with and without autograd."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .channel import CLIENT_LOCK
from .devices import DEVICES
from .tensor import ProxyTensor, SpecialHandler, download, fill, forward, upload_to


def upload(tensor: torch.Tensor, index: int) -> ProxyTensor:
    """A stand-in on cuda:index with a tensor's values (no autograd)."""
    if isinstance(tensor, ProxyTensor):
        if tensor._channel.index == index:
            return tensor
        tensor = download(tensor)
    return upload_to(DEVICES.channel(index), tensor)


class _Upload(torch.autograd.Function):
    """Differentiable host-to-device copy."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, index: int) -> Any:
        return upload(tensor, index)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        with CLIENT_LOCK:  # autograd's threads (distributed autograd runs several at once)
            return (download(grad) if isinstance(grad, ProxyTensor) else grad), None


class _Download(torch.autograd.Function):
    """Differentiable device-to-host copy."""

    @staticmethod
    def forward(ctx: Any, stand_in: ProxyTensor) -> Any:
        ctx.index = stand_in._channel.index
        return download(stand_in)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        with CLIENT_LOCK:  # as above: two uploads at once would take the same handle
            return upload(grad, ctx.index)


def to_device(tensor: torch.Tensor, index: int) -> Any:
    """Host-to-device copy that autograd records when the tensor requires grad."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Upload.apply(tensor, index)
    return upload(tensor, index)


def to_host(stand_in: ProxyTensor) -> Any:
    """Device-to-host copy that autograd records when the stand-in requires grad."""
    if stand_in.requires_grad and torch.is_grad_enabled():
        return _Download.apply(stand_in)
    return download(stand_in)


def _copy_(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`dst.copy_(src)` where either side may be on the host or on another device."""
    dst, src = args[0], args[1]
    if isinstance(dst, ProxyTensor) and not isinstance(src, ProxyTensor):
        fill(dst, src.expand(dst.shape))
        return dst
    if not isinstance(dst, ProxyTensor):
        dst.copy_(download(src))
        return dst
    if dst._channel is not src._channel:
        fill(dst, download(src).expand(dst.shape))
        return dst
    return forward(func, args, kwargs)


def _sizes_on_host(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`_pack_padded_sequence` and `_pad_packed_sequence` (RNNs' packed sequences): as on CUDA, the
    sequences are made on the device and the batch sizes or lengths returned beside them on the
    host. Those depend only on the host lengths or batch sizes given, so the host works them out
    on one-feature zeros in place of the sequences, with the same checks and errors."""
    sizes = args[1]
    if isinstance(sizes, ProxyTensor):  # CUDA's own check
        kind = sizes.type().rsplit(".", 1)[-1].removesuffix("Tensor")  # torch.cuda.LongTensor: Long
        found = f"{sizes.dim()}D {sizes.device} {kind} tensor"
        raise RuntimeError(f"'lengths' argument should be a 1D CPU int64 tensor, but got {found}")
    sequences, _ = forward(func, args, kwargs)
    first = args[0]
    leading = 2 if func is torch.ops.aten._pack_padded_sequence.default else 1
    zeros = torch.zeros(*first.shape[:leading], 1, dtype=first.dtype)
    _, sizes = func(zeros, *args[1:], **kwargs)
    return sequences, sizes


_META = torch.device("meta")


def _to_copy(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`_to_copy` (`.to(...)`): to the meta device (accelerate's offloading and
    `init_empty_weights`, `Module.to("meta")`) a meta tensor of the stand-in's layout, as a GPU's
    tensor gives; any other copy runs on the server."""
    device = kwargs.get("device")
    if device is None or torch.device(device) != _META:
        return forward(func, args, kwargs)
    source = args[0]
    layout = torch.empty_strided(source.shape, source.stride(), dtype=source.dtype, device=_META)
    return torch.empty_like(
        layout, dtype=kwargs.get("dtype"), memory_format=kwargs.get("memory_format") or torch.preserve_format
    )


TRANSFER_OPS: dict[Any, SpecialHandler] = {
    torch.ops.aten.copy_.default: _copy_,
    torch.ops.aten._to_copy.default: _to_copy,
    torch.ops.aten._pack_padded_sequence.default: _sizes_on_host,
    torch.ops.aten._pad_packed_sequence.default: _sizes_on_host,
}
"""Operators that move data between the host and devices, carried out by the client."""
