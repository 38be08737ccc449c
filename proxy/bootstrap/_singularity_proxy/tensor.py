# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""Stand-in tensors and the dispatch of every aten operation on them to the proxy server.

A stand-in is a `__torch_dispatch__` wrapper tensor whose C++ device is the host (so that
C++ and autograd never meet an accelerator) and whose Python `device` says `cuda:N`. Its
data lives in the server under a handle. An operation on stand-ins is encoded (stand-ins
become handle references), queued on the device's channel, and answered from the cache of
output templates keyed by the operation's signature; a signature not seen before asks the
server once, so shapes, strides and error messages are the real kernel's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import protocol
from .channel import Channel
from .devices import same_device_error

HOST = torch.device("cpu")
_make_wrapper = torch.Tensor._make_wrapper_subclass

SpecialHandler = Callable[[Any, Sequence[Any], dict[str, Any]], Any]
special_ops: dict[Any, SpecialHandler] = {}
"""Operators the client carries out itself (random numbers, copies across devices); filled by
the modules that own them when the client is installed."""


class TensorHandle:
    """Owns one server-side tensor id; queues its release when the stand-in dies."""

    __slots__ = ("channel", "id")

    def __init__(self, channel: Channel, handle: int) -> None:
        self.channel = channel
        self.id = handle

    def __del__(self) -> None:
        try:  # noqa: SIM105 (hot path: no context manager)
            self.channel.freed.append(self.id)
        except Exception:
            pass


class ProxyTensor(torch.Tensor):
    """A tensor on a proxied cuda device: metadata here, data in the proxy server."""

    _handle: TensorHandle
    _wire_ref: slice  # how the handle travels in arguments
    _meta: tuple[Any, ...]  # (shape, stride, storage offset, dtype): part of operation signatures
    _channel: Channel

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        return dispatch(func, args, kwargs)

    @property  # type: ignore[misc]
    def device(self) -> torch.device:  # type: ignore[override]
        return self._channel.device

    @property  # type: ignore[misc]
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property  # type: ignore[misc]
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False

    def get_device(self) -> int:  # type: ignore[override]
        return self._channel.index

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return _repr(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone()
        if self.requires_grad:
            new.requires_grad_(True)
        if getattr(self, "_is_param", False):
            new = torch.nn.Parameter(new, requires_grad=self.requires_grad)
        if self.grad is not None:
            new.grad = self.grad.__deepcopy__(memo)  # type: ignore[operator]
        memo[id(self)] = new
        return new


def new_stand_in(channel: Channel, handle: int, meta: tuple[Any, ...]) -> ProxyTensor:
    """The stand-in for server tensor `handle`, with meta (shape, stride, storage offset, dtype)."""
    tensor = _make_wrapper(ProxyTensor, meta[0], meta[1], meta[2], None, meta[3], torch.strided, HOST)
    tensor._handle = TensorHandle(channel, handle)
    tensor._wire_ref = slice(handle)
    tensor._meta = meta
    tensor._channel = channel
    return tensor  # type: ignore[no-any-return]


def download(stand_in: torch.Tensor) -> Any:
    """A new host tensor with a stand-in's values (waits for the device)."""
    assert isinstance(stand_in, ProxyTensor)
    dtype, shape, stride, raw = stand_in._channel.request((protocol.REQ_FETCH, stand_in._handle.id))
    return protocol.tensor_from_raw(dtype, shape, stride, raw)


# -- encoding of arguments ---------------------------------------------------------------------
# Each encoder returns the arguments as they travel and appends to `signature` what the output
# template depends on (stand-ins' metadata, plain values, float-ness of Python scalars).
_FLOAT = float


def _encode_sequence(seq: Sequence[Any], signature: list[Any], inputs: list[ProxyTensor]) -> list[Any]:
    out: list[Any] = []
    for arg in seq:
        kind = type(arg)
        if kind is ProxyTensor:
            inputs.append(arg)
            signature.append(arg._meta)
            out.append(arg._wire_ref)
        elif kind is int or kind is float or kind is str or arg is None:
            signature.append(arg)
            out.append(arg)
        else:
            out.append(_encode_other(arg, kind, signature, inputs))
    return out


def _encode_other(arg: Any, kind: type, signature: list[Any], inputs: list[ProxyTensor]) -> Any:
    if kind is list or kind is tuple:
        nested: list[Any] = []
        encoded = _encode_sequence(arg, nested, inputs)
        signature.append(tuple(nested))
        return encoded
    if kind is bool:
        signature.append((bool, arg))
        return arg
    if isinstance(arg, ProxyTensor):
        inputs.append(arg)
        signature.append(arg._meta)
        return arg._wire_ref
    if isinstance(arg, torch.Tensor):
        # A host tensor reaching an operation on stand-ins: a scalar, or one that torch's
        # C++ made with the stand-in's (host) options. Mixing by the program is caught in
        # the torch-function mode, as the device would catch it.
        host = arg.detach()
        if host.device.type != "cpu":
            raise same_device_error("cuda:0", str(host.device))
        signature.append(("cpu", tuple(host.shape), tuple(host.stride()), host.dtype))
        host, raw = protocol.tensor_to_raw(host)
        return ("t", host.dtype, tuple(host.shape), tuple(host.stride()), raw)
    if kind is torch.device:
        signature.append(protocol.DEVICE_MARKER)
        return protocol.DEVICE_MARKER
    signature.append(arg)
    return arg


def encode_arguments(
    args: Sequence[Any], kwargs: dict[str, Any] | None
) -> tuple[list[Any], dict[str, Any] | None, list[Any], list[ProxyTensor]]:
    """Arguments and keyword arguments as they travel, the operation's signature, the stand-ins."""
    signature: list[Any] = []
    inputs: list[ProxyTensor] = []
    wire_args: list[Any] = []
    for arg in args:
        kind = type(arg)
        if kind is ProxyTensor:
            inputs.append(arg)
            signature.append(arg._meta)
            wire_args.append(arg._wire_ref)
        elif kind is int or kind is str or arg is None:
            signature.append(arg)
            wire_args.append(arg)
        elif kind is float:
            signature.append(_FLOAT)
            wire_args.append(arg)
        else:
            wire_args.append(_encode_other(arg, kind, signature, inputs))
    wire_kwargs = None
    if kwargs:
        wire_kwargs = {}
        for name, value in kwargs.items():
            signature.append(name)
            kind = type(value)
            if kind is float:
                signature.append(_FLOAT)
                wire_kwargs[name] = value
            elif kind is int or kind is str or value is None:
                signature.append(value)
                wire_kwargs[name] = value
            else:
                wire_kwargs[name] = _encode_other(value, kind, signature, inputs)
    return wire_args, wire_kwargs, signature, inputs


# -- building outputs from a template ------------------------------------------------------------
def _count_new(template: Any) -> tuple[int, int, bool]:
    """Number of new tensors, bytes of new storage, and whether a plain value is returned."""
    tag = template[0]
    if tag == protocol.TEMPLATE_TENSOR:
        return 1, template[2], False
    if tag in (protocol.TEMPLATE_LIST, protocol.TEMPLATE_TUPLE):
        count = nbytes = 0
        has_value = False
        for item in template[1]:
            item_count, item_bytes, item_value = _count_new(item)
            count += item_count
            nbytes += item_bytes
            has_value = has_value or item_value
        return count, nbytes, has_value
    if tag == protocol.TEMPLATE_VALUE:
        return 0, 0, True
    return 0, 0, False


def _build(template: Any, channel: Channel, inputs: list[ProxyTensor], next_handle: list[int]) -> Any:
    """The outputs an operation returned, from its template; new handles taken in order."""
    tag = template[0]
    if tag == protocol.TEMPLATE_TENSOR:
        handle = next_handle[0]
        next_handle[0] = handle + 1
        return new_stand_in(channel, handle, template[1])
    if tag == protocol.TEMPLATE_ALIAS:
        return inputs[template[1]]
    if tag == protocol.TEMPLATE_LIST:
        return [_build(item, channel, inputs, next_handle) for item in template[1]]
    if tag == protocol.TEMPLATE_TUPLE:
        return tuple(_build(item, channel, inputs, next_handle) for item in template[1])
    if tag == protocol.TEMPLATE_VALUE:
        return template[1]
    return None


def _value_dependent(func: Any, args: Sequence[Any]) -> bool:
    """Whether the operation's outputs depend on input values (never cached)."""
    tags = func.tags
    if torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags:
        if func is torch.ops.aten.index.Tensor:
            return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
        return True
    return False


def dispatch(func: Any, args: Sequence[Any], kwargs: dict[str, Any] | None) -> Any:
    """Carry out one aten operation on stand-ins (most are forwarded to the proxy server)."""
    special = special_ops.get(func)
    if special is not None:
        return special(func, args, kwargs or {})
    return forward(func, args, kwargs)


def forward(func: Any, args: Sequence[Any], kwargs: dict[str, Any] | None) -> Any:
    """Send one aten operation to the server; its outputs as stand-ins."""
    wire_args, wire_kwargs, signature, inputs = encode_arguments(args, kwargs)
    channel = inputs[0]._channel
    for stand_in in inputs:
        if stand_in._channel is not channel:
            raise same_device_error(str(channel.device), str(stand_in._channel.device))
    key = (func, tuple(signature))
    cached = channel.templates.get(key)
    if cached is not None:
        template, count, nbytes = cached
        if nbytes < channel.sync_bytes:
            first = channel.new_handle(count)
            channel.push((protocol.OP_CALL, channel.op_id(func), first, wire_args, wire_kwargs))
            if template[0] == protocol.TEMPLATE_TENSOR:
                return new_stand_in(channel, first, template[1])
            return _build(template, channel, inputs, [first])
    op_id = channel.op_id(func)
    first = channel.next_handle
    template = channel.request((protocol.REQ_CALL, op_id, first, wire_args, wire_kwargs))
    count, nbytes, has_value = _count_new(template)
    channel.next_handle = first + count
    if not has_value and not _value_dependent(func, args):
        channel.templates[key] = (template, count, nbytes)
    return _build(template, channel, inputs, [first])


# -- printing ------------------------------------------------------------------------------------
def _repr(stand_in: ProxyTensor) -> str:
    """What torch prints for a cuda tensor with these values."""
    from torch import _tensor_str

    with torch.no_grad():
        host = download(stand_in)
    contents = "[]" if host.numel() == 0 else _tensor_str._tensor_str(host, len("tensor("))
    name = ProxyTensor.__name__
    ProxyTensor.__name__ = "tensor"
    try:
        text: str = _tensor_str._str(stand_in, tensor_contents=contents)
    finally:
        ProxyTensor.__name__ = name
    if getattr(stand_in, "_is_param", False):
        if text.startswith("Parameter(") and text.endswith(")"):
            text = text[len("Parameter(") : -1]
        return "Parameter containing:\n" + text
    return text
