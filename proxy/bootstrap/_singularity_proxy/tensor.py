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
namespace_ops: dict[str, Callable[[Any], SpecialHandler | None]] = {}
"""Per namespace, what finds the handler of an operator that exists only once a library is
imported (collectives, FSDP's own operators); a handler found is kept in `special_ops`."""


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
    _wire_ref: dict[str, int]  # how the handle travels in arguments
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

    def untyped_storage(self) -> Any:  # type: ignore[override]
        return ProxyStorage(self)

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


class ProxyStorage:
    """What `untyped_storage()` gives for a stand-in: its size, and resizing (FSDP frees and
    re-allocates the storage of its unsharded parameters this way)."""

    def __init__(self, stand_in: ProxyTensor) -> None:
        self.stand_in = stand_in

    def size(self) -> int:
        """Bytes of the storage (as last resized here, else what the stand-in's layout spans)."""
        resized = getattr(self.stand_in, "_storage_bytes", None)
        if resized is not None:
            return int(resized)
        shape, stride, offset, dtype = self.stand_in._meta
        return int(protocol.storage_extent(shape, stride, offset) * dtype.itemsize)

    nbytes = size

    def resize_(self, nbytes: int) -> ProxyStorage:
        """Resize the storage on the device (the tensor keeps its shape; its views share the storage)."""
        stand_in = self.stand_in
        stand_in._channel.push([protocol.OP_RESIZE_STORAGE, stand_in._handle.id, int(nbytes)])
        stand_in._storage_bytes = int(nbytes)  # type: ignore[attr-defined]
        return self


def new_stand_in(channel: Channel, handle: int, meta: tuple[Any, ...]) -> ProxyTensor:
    """The stand-in for server tensor `handle`, with meta (shape, stride, storage offset, dtype)."""
    tensor = _make_wrapper(ProxyTensor, meta[0], meta[1], meta[2], None, meta[3], torch.strided, HOST)
    tensor._handle = TensorHandle(channel, handle)
    tensor._wire_ref = {protocol.TAG_HANDLE: handle}
    tensor._meta = meta
    tensor._channel = channel
    return tensor  # type: ignore[no-any-return]


# -- values between the host and the server ------------------------------------------------------
def download(stand_in: torch.Tensor) -> Any:
    """A new host tensor with a stand-in's values (waits for the device)."""
    assert isinstance(stand_in, ProxyTensor)
    dtype, shape, stride, raw = stand_in._channel.request([protocol.REQ_FETCH, stand_in._handle.id])
    return protocol.tensor_from_raw(dtype, shape, stride, raw)


def upload_to(channel: Channel, tensor: torch.Tensor) -> ProxyTensor:
    """A stand-in on the channel's device with a host tensor's values (no autograd).

    Up to CHUNK_BYTES travel with one OP_UPLOAD; larger tensors are allocated (OP_ALLOCATE)
    and written chunk by chunk (OP_WRITE), one frame each. Uploads of `sync_bytes` or more
    wait for the server, so that running out of device memory shows at the call.
    """
    with torch.no_grad():
        host, raw = protocol.tensor_to_raw(tensor.detach())
    handle = channel.new_handle()
    meta = (tuple(host.shape), tuple(host.stride()), 0, host.dtype)
    layout = [_NAMES.dtype_names[host.dtype], list(meta[0]), list(meta[1])]
    if raw.nbytes <= protocol.CHUNK_BYTES:
        index = channel.attach([raw])
        op: list[Any] = [protocol.OP_UPLOAD, handle, *layout, index]
        if raw.nbytes >= channel.sync_bytes:
            channel.pending.append(op)
            channel.request([protocol.REQ_SYNC])
        else:
            channel.push(op)
    else:
        channel.push([protocol.OP_ALLOCATE, handle, *layout])
        try:
            channel.request([protocol.REQ_SYNC])
        except BaseException:
            channel.freed.append(handle)
            raise
        for offset in range(0, raw.nbytes, protocol.CHUNK_BYTES):
            index = channel.attach([raw[offset : offset + protocol.CHUNK_BYTES]])
            channel.push([protocol.OP_WRITE, handle, offset, index])
        channel.request([protocol.REQ_SYNC])
    return new_stand_in(channel, handle, meta)


def fill(stand_in: ProxyTensor, values: torch.Tensor) -> None:
    """Overwrite a stand-in's values with those of a host tensor of the same shape."""
    with torch.no_grad():
        host = torch.empty_strided(stand_in.shape, stand_in.stride(), dtype=stand_in.dtype)
        host.copy_(values)
    raw = protocol.storage_view(host)
    channel = stand_in._channel
    if raw.nbytes > HOST_ARGUMENT_BYTES:
        forward(torch.ops.aten.copy_.default, (stand_in, upload_to(channel, host)), None)
        return
    index = channel.attach([raw])
    layout = [_NAMES.dtype_names[host.dtype], list(host.shape), list(host.stride())]
    channel.push([protocol.OP_FILL, stand_in._handle.id, *layout, index])


# -- encoding of arguments -----------------------------------------------------------------------
# The encoders turn arguments into their JSON-ready wire form (protocol.py) and append to
# `signature` what the output template depends on (stand-ins' metadata, plain values, the
# float-ness of Python scalars). Host tensors travel as buffers, listed in `host_tensors` as
# (tag payload, bytes): the payload's last element becomes the buffer's index in the frame.
_FLOAT = float
_NAMES = protocol.torch_names()
_TORCH_VALUE_TAGS = _NAMES.encoders
HOST_ARGUMENT_BYTES = protocol.CHUNK_BYTES // 4
"""Host tensors larger than this reach the server as uploaded tensors, not inside the operation."""


class _LargeHostTensor(Exception):
    """A host tensor argument too large to travel inside an operation."""


class Encoded:
    """An operation's arguments as they travel, its signature, stand-ins and host tensors."""

    __slots__ = ("args", "host_tensors", "inputs", "kwargs", "signature")

    def __init__(self) -> None:
        self.args: list[Any] = []
        self.kwargs: dict[str, Any] | None = None
        self.signature: list[Any] = []
        self.inputs: list[ProxyTensor] = []
        self.host_tensors: list[tuple[list[Any], memoryview]] = []


def _encode_sequence(seq: Sequence[Any], signature: list[Any], encoded: Encoded) -> list[Any]:
    out: list[Any] = []
    for arg in seq:
        kind = type(arg)
        if kind is ProxyTensor:
            encoded.inputs.append(arg)
            signature.append(arg._meta)
            out.append(arg._wire_ref)
        elif kind is int or kind is float or kind is str or arg is None:
            signature.append(arg)
            out.append(arg)
        else:
            out.append(_encode_other(arg, kind, signature, encoded))
    return out


def _encode_other(arg: Any, kind: type, signature: list[Any], encoded: Encoded) -> Any:
    if kind is list or kind is tuple or isinstance(arg, (list, tuple)):  # torch.Size is a tuple
        nested: list[Any] = []
        out = _encode_sequence(arg, nested, encoded)
        signature.append(tuple(nested))
        return out
    if kind is bool:
        signature.append((bool, arg))
        return arg
    tag = _TORCH_VALUE_TAGS.get(kind)
    if tag is not None:
        signature.append(arg)
        return tag(arg)
    if isinstance(arg, ProxyTensor):
        encoded.inputs.append(arg)
        signature.append(arg._meta)
        return arg._wire_ref
    if isinstance(arg, torch.Tensor):
        return _encode_host_tensor(arg, signature, encoded)
    if kind is torch.device:
        signature.append(kind)
        return protocol.DEVICE_MARKER
    if kind is complex:
        signature.append(arg)
        return {protocol.TAG_COMPLEX: [arg.real, arg.imag]}
    for plain in (bool, int, float, str):  # subclasses of the plain types travel as those
        if isinstance(arg, plain):
            return _encode_sequence([plain(arg)], signature, encoded)[0]
    raise TypeError(f"proxy: an argument of type {kind.__qualname__} cannot be sent to the device")


def _encode_host_tensor(arg: torch.Tensor, signature: list[Any], encoded: Encoded) -> Any:
    """A host tensor reaching an operation on stand-ins.

    It is a scalar, or one that torch's C++ made with the stand-in's (host) options: mixing
    by the program is caught in the torch-function mode, as the device would catch it.
    """
    host = arg.detach()
    if host.device.type != "cpu":
        raise same_device_error("cuda:0", str(host.device))
    if host.numel() * host.element_size() > HOST_ARGUMENT_BYTES:
        raise _LargeHostTensor
    signature.append(("cpu", tuple(host.shape), tuple(host.stride()), host.dtype))
    host, raw = protocol.tensor_to_raw(host)
    payload = [_NAMES.dtype_names[host.dtype], list(host.shape), list(host.stride()), -1]
    encoded.host_tensors.append((payload, raw))
    return {protocol.TAG_HOST_TENSOR: payload}


def encode_arguments(args: Sequence[Any], kwargs: dict[str, Any] | None) -> Encoded:
    """Arguments and keyword arguments as they travel, with the operation's signature."""
    encoded = Encoded()
    signature = encoded.signature
    inputs = encoded.inputs
    wire_args = encoded.args
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
            wire_args.append(_encode_other(arg, kind, signature, encoded))
    if kwargs:
        wire_kwargs: dict[str, Any] = {}
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
                wire_kwargs[name] = _encode_other(value, kind, signature, encoded)
        encoded.kwargs = wire_kwargs
    return encoded


def _upload_large_host_tensors(value: Any, channel: Channel) -> Any:
    """`value` with every large host tensor in it replaced by a stand-in on the channel's device."""
    if isinstance(value, torch.Tensor) and not isinstance(value, ProxyTensor):
        if value.numel() * value.element_size() > HOST_ARGUMENT_BYTES:
            return upload_to(channel, value)
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_upload_large_host_tensors(item, channel) for item in value)
    return value


def _first_stand_in(value: Any) -> ProxyTensor | None:
    """The first stand-in in (nested) arguments."""
    if isinstance(value, ProxyTensor):
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_stand_in(item)
            if found is not None:
                return found
    return None


# -- building outputs from a template ------------------------------------------------------------
def _parse_template(tree: Any) -> Any:
    """The client's form of a template from the wire: tensor metadata as a hashable tuple."""
    tag = tree[0]
    if tag == protocol.TEMPLATE_TENSOR:
        _, shape, stride, offset, dtype, nbytes = tree
        return (tag, (tuple(shape), tuple(stride), offset, _NAMES.dtype(dtype)), nbytes)
    if tag in (protocol.TEMPLATE_LIST, protocol.TEMPLATE_TUPLE):
        return (tag, [_parse_template(item) for item in tree[1]])
    return tuple(tree)


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
    if special is None and func.namespace in namespace_ops:
        special = namespace_ops[func.namespace](func)
        if special is not None:
            special_ops[func] = special
    if special is not None:
        return special(func, args, kwargs or {})
    return forward(func, args, kwargs)


def forward(func: Any, args: Sequence[Any], kwargs: dict[str, Any] | None) -> Any:
    """Send one aten operation to the server; its outputs as stand-ins."""
    try:
        encoded = encode_arguments(args, kwargs)
    except _LargeHostTensor:
        target = _first_stand_in([*args, *(kwargs or {}).values()])
        assert target is not None
        args = _upload_large_host_tensors(list(args), target._channel)
        kwargs = {k: _upload_large_host_tensors(v, target._channel) for k, v in (kwargs or {}).items()}
        encoded = encode_arguments(args, kwargs)
    inputs = encoded.inputs
    channel = inputs[0]._channel
    for stand_in in inputs:
        if stand_in._channel is not channel:
            raise same_device_error(str(channel.device), str(stand_in._channel.device))
    if encoded.host_tensors:
        first = channel.attach([raw for _, raw in encoded.host_tensors])
        for position, (payload, _raw) in enumerate(encoded.host_tensors):
            payload[3] = first + position
    key = (func, tuple(encoded.signature))
    cached = channel.templates.get(key)
    if cached is not None:
        template, count, nbytes = cached
        if nbytes < channel.sync_bytes:
            first = channel.new_handle(count)
            channel.push([protocol.OP_CALL, channel.op_id(func), first, encoded.args, encoded.kwargs])
            if template[0] == protocol.TEMPLATE_TENSOR:
                return new_stand_in(channel, first, template[1])
            return _build(template, channel, inputs, [first])
    op_id = channel.op_id(func)
    first = channel.next_handle
    reply = channel.request([protocol.REQ_CALL, op_id, first, encoded.args, encoded.kwargs])
    template = _parse_template(reply)
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
