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

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import protocol
from .channel import CLIENT_LOCK, Channel
from .devices import same_device_error
from .storages import ProxyStorage, ProxyTypedStorage, StorageRecord, storage_record, viewed_argument

HOST = torch.device("cpu")
_make_wrapper = torch.Tensor._make_wrapper_subclass

SpecialHandler = Callable[[Any, Sequence[Any], dict[str, Any]], Any]
special_ops: dict[Any, SpecialHandler] = {
    torch.ops.aten.detach.default: lambda f, a, k: _detach(f, a, k),
}
"""Operators the client carries out itself (random numbers, copies across devices); filled by
the modules that own them when the client is installed."""
namespace_ops: dict[str, Callable[[Any], SpecialHandler | None]] = {}
"""Per namespace, what finds the handler of an operator that exists only once a library is
imported (collectives, FSDP's own operators); asked by the first of `special_rules`."""
special_rules: list[Callable[[Any], SpecialHandler | None]] = [
    lambda func: namespace_ops[func.namespace](func) if func.namespace in namespace_ops else None,
    lambda func: custom_op_handler(func),
    lambda func: in_place_view_handler(func),
]
"""Rules giving the handler of an operator not in special_ops (None: forwarded), asked once per
operator (random operators by their tag)."""
_routes: dict[int, SpecialHandler | None] = {}
_UNROUTED: Any = object()
"""id(operator) -> its handler, or None for forwarded operators (filled on first use)."""


def _sparse_not_installed(*args: Any) -> Any:
    raise RuntimeError("proxy: sparse stand-ins are made by the installed client (sparse.py)")


new_sparse_stand_in: Callable[[Channel, int, tuple[Any, ...]], ProxyTensor] = _sparse_not_installed
upload_sparse: Callable[[Channel, torch.Tensor], ProxyTensor] = _sparse_not_installed
sparse_from_parts: Callable[[dict[str, Any]], torch.Tensor] = _sparse_not_installed
"""How this module makes, uploads and downloads sparse stand-ins: set by sparse.py's `install`
(sparse.py builds on this module, so this one imports nothing of it)."""


class TensorHandle:
    """Owns one server-side tensor id; queues its release when the last stand-in using it dies.

    Stand-ins of `detach` share their source's handle (the server tensor is the same); such a
    handle is `shared`, and an in-place view operation (t_, resize_, ...) on a stand-in with a
    shared handle first gives it a handle of its own.
    """

    __slots__ = ("channel", "id", "shared")

    def __init__(self, channel: Channel, handle: int) -> None:
        self.channel = channel
        self.id = handle
        self.shared = False

    def __del__(self) -> None:
        try:  # noqa: SIM105 (hot path: no context manager)
            self.channel.freed.append(self.id)
        except Exception:
            pass


class ProxyTensor(torch.Tensor):
    """A tensor on a proxied cuda device: metadata here, data in the proxy server."""

    _handle: TensorHandle
    _id: int  # the handle's number, as it travels
    _meta: tuple[Any, ...]  # (shape, stride, storage offset, dtype): part of operation signatures
    _channel: Channel
    _storage: StorageRecord  # the storage it views, once a view was made of it or its address asked

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __new__(cls, data: Any = None, requires_grad: bool = True) -> Any:
        """`type(parameter)(tensor, requires_grad=...)`: a device parameter's type is this class
        (`isinstance(p, nn.Parameter)` holds by its `_is_param`), and libraries that re-wrap a
        parameter by its type (accelerate's `set_module_tensor_to_device`, behind `device_map`
        and offloading) get `nn.Parameter(data, requires_grad)`, as on a GPU. Stand-ins themselves
        are made by `new_stand_in`, not by calling the class."""
        return torch.nn.Parameter(data, requires_grad)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        with CLIENT_LOCK:
            route = _routes.get(id(func), _UNROUTED)  # `dispatch`, inlined: this runs for every operation
            if route is None:
                return forward(func, args, kwargs)
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

    def __format__(self, format_spec: str) -> str:
        # torch formats only a plain 0-dim Tensor as its number (`type(self) is Tensor`)
        is_parameter = getattr(self, "_is_param", False)
        if self.dim() == 0 and not is_parameter:
            return format(self.detach().item(), format_spec)
        if format_spec:
            kind = "Parameter" if is_parameter else "Tensor"
            raise TypeError(f"unsupported format string passed to {kind}.__format__")
        return str(self)

    def untyped_storage(self) -> Any:  # type: ignore[override]
        return ProxyStorage(self)

    def storage(self) -> Any:  # type: ignore[override]
        return ProxyTypedStorage(self)

    def _typed_storage(self) -> Any:
        return ProxyTypedStorage(self)

    def data_ptr(self) -> int:  # type: ignore[override]
        return storage_record(self).address() + int(self._meta[2] * self._meta[3].itemsize)

    def __copy__(self) -> Any:
        """`copy.copy`: a tensor sharing this one's storage, as torch rebuilds a shallow copy (a
        Parameter stays one; its reduction for pickles holds an object only a pickle rebuilds)."""
        new = self.detach()
        if getattr(self, "_is_param", False):
            return torch.nn.Parameter(new, requires_grad=self.requires_grad)
        return new.requires_grad_(self.requires_grad) if self.is_leaf else new

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone()
        if self.requires_grad:
            new.requires_grad_(True)
        if getattr(self, "_is_param", False):  # as Parameter.__deepcopy__: without its grad
            new = torch.nn.Parameter(new, requires_grad=self.requires_grad)
        elif self.grad is not None:
            new.grad = self.grad.__deepcopy__(memo)  # type: ignore[operator]
        memo[id(self)] = new
        return new


def share_storage(outputs: Any, source: Any) -> None:
    """Record that the new stand-ins among `outputs` view the storage of stand-in `source`."""
    if isinstance(outputs, ProxyTensor):
        if outputs is not source:
            outputs._storage = storage_record(source)
    elif isinstance(outputs, (list, tuple)):
        for output in outputs:
            share_storage(output, source)


def new_stand_in(channel: Channel, handle: int, meta: tuple[Any, ...]) -> ProxyTensor:
    """The stand-in for server tensor `handle`, with meta (shape, stride, storage offset, dtype)."""
    tensor = _make_wrapper(ProxyTensor, meta[0], meta[1], meta[2], None, meta[3], torch.strided, HOST)
    tensor._handle = TensorHandle(channel, handle)
    tensor._id = handle
    tensor._meta = meta
    tensor._channel = channel
    return tensor  # type: ignore[no-any-return]


def _detach(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`detach`: a stand-in of the same server tensor (nothing is sent)."""
    source = args[0]
    if source.layout != torch.strided:
        return forward(func, args, kwargs)
    meta = source._meta
    with _view_context(source):
        tensor = _make_wrapper(ProxyTensor, meta[0], meta[1], meta[2], None, meta[3], torch.strided, HOST)
    stand_for(tensor, source)
    return tensor


def stand_for(tensor: Any, source: ProxyTensor) -> None:
    """Make stand-in `tensor` name `source`'s server tensor and storage (sharing its handle), as
    `detach` and `tensor.data = source` do; its C++ metadata is the caller's to set."""
    handle = source._handle
    handle.shared = True
    tensor._handle = handle
    tensor._id = handle.id
    tensor._meta = source._meta
    tensor._channel = source._channel
    tensor._storage = storage_record(source)


def _in_place_view(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """An operation changing its input's shape or strides in place: on a handle of its own."""
    target = args[0]
    if target._handle.shared:
        own = forward(torch.ops.aten.alias.default, (target,), None)
        target._handle = own._handle
        target._id = own._id
    return forward(func, args, kwargs)


def in_place_view_handler(func: Any) -> SpecialHandler | None:
    """The handler of operators that change their input's shape or strides in place."""
    return _in_place_view if torch.Tag.inplace_view in func.tags else None


# -- values between the host and the server ------------------------------------------------------
def download(stand_in: torch.Tensor) -> Any:
    """A new host tensor with a stand-in's values (waits for the device)."""
    assert isinstance(stand_in, ProxyTensor)
    answer = stand_in._channel.request([protocol.REQ_FETCH, stand_in._handle.id])
    if type(answer) is dict:
        return sparse_from_parts(answer)
    return protocol.tensor_from_raw(*answer)


def upload_to(channel: Channel, tensor: torch.Tensor) -> ProxyTensor:
    """A stand-in on the channel's device with a host tensor's values (no autograd).

    Up to CHUNK_BYTES travel with one OP_UPLOAD; larger tensors are allocated (OP_ALLOCATE)
    and written chunk by chunk (OP_WRITE), one frame each. Uploads of `sync_bytes` or more
    wait for the server, so that running out of device memory shows at the call.
    """
    if tensor.layout != torch.strided:
        return upload_sparse(channel, tensor)
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
    if raw.nbytes > protocol.HOST_ARGUMENT_BYTES:
        forward(torch.ops.aten.copy_.default, (stand_in, upload_to(channel, host)), None)
        return
    index = channel.attach([raw])
    layout = [_NAMES.dtype_names[host.dtype], list(host.shape), list(host.stride())]
    channel.push([protocol.OP_FILL, stand_in._handle.id, *layout, index])


_NAMES = protocol.torch_names()


def _upload_large_host_tensors(value: Any, channel: Channel) -> Any:
    """`value` with every large host tensor in it replaced by a stand-in on the channel's device."""
    if isinstance(value, torch.Tensor) and not isinstance(value, ProxyTensor):
        if value.numel() * value.element_size() > protocol.HOST_ARGUMENT_BYTES:
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
    if tag == protocol.TEMPLATE_SPARSE:
        _, layout, shape, dtype, nbytes = tree
        return (tag, (tuple(shape), _NAMES.layouts[layout], 0, _NAMES.dtype(dtype)), nbytes)
    if tag == protocol.TEMPLATE_RESHAPED:
        _, position, shape, stride, offset = tree
        return (tag, position, (tuple(shape), tuple(stride), offset))
    return tuple(tree)


def _count_new(template: Any) -> tuple[int, int, bool]:
    """Number of new tensors, bytes of new storage, and whether the outputs depend on values (a
    plain value, or a sparse tensor, whose number of elements depends on its values): such a
    template is not kept for the next call of the signature."""
    tag = template[0]
    if tag == protocol.TEMPLATE_TENSOR:
        return 1, template[2], False
    if tag == protocol.TEMPLATE_SPARSE:
        return 1, template[2], True
    if tag in (protocol.TEMPLATE_LIST, protocol.TEMPLATE_TUPLE):
        count = nbytes = 0
        depends_on_values = False
        for item in template[1]:
            item_count, item_bytes, item_depends = _count_new(item)
            count += item_count
            nbytes += item_bytes
            depends_on_values = depends_on_values or item_depends
        return count, nbytes, depends_on_values
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
    if tag == protocol.TEMPLATE_SPARSE:
        handle = next_handle[0]
        next_handle[0] = handle + 1
        return new_sparse_stand_in(channel, handle, template[1])
    if tag == protocol.TEMPLATE_ALIAS:
        return inputs[template[1]]
    if tag == protocol.TEMPLATE_RESHAPED:
        return _reshape(inputs[template[1]], *template[2])
    if tag == protocol.TEMPLATE_LIST:
        return [_build(item, channel, inputs, next_handle) for item in template[1]]
    if tag == protocol.TEMPLATE_TUPLE:
        return tuple(_build(item, channel, inputs, next_handle) for item in template[1])
    if tag == protocol.TEMPLATE_VALUE:
        return template[1]
    return None


def _reshape(stand_in: ProxyTensor, shape: Any, stride: Any, offset: int) -> ProxyTensor:
    """Give a stand-in the shape, stride and offset an in-place view operation gave its tensor.

    The stand-in's C++ metadata is set the way torch sets a wrapper subclass's for in-place
    views (`return_and_correct_aliasing`): `set_` with dispatch off and the meta kernels on,
    which allocates nothing.
    """
    with torch._C._DisableTorchDispatch():
        meta_before = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            stand_in.set_(torch.Tensor.untyped_storage(stand_in), offset, shape, stride)  # C++ storage
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_before)
    stand_in._meta = (shape, stride, offset, stand_in._meta[3])
    return stand_in


def _value_dependent(func: Any, args: Sequence[Any]) -> bool:
    """Whether the operation's outputs depend on input values (never cached): a sparse input's
    number of elements is one (its layout does not show it)."""
    tags = func.tags
    if torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags:
        if func is torch.ops.aten.index.Tensor:
            return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
        return True
    return any(isinstance(arg, ProxyTensor) and arg.layout != torch.strided for arg in args)


def custom_op_handler(func: Any) -> SpecialHandler | None:
    """For a Python custom operator of a namespace the server does not serve (torch's own
    `torch_nn::` operators), a handler running its implementation here: the operations it
    makes reach the server. None for any other operator."""
    if func.namespace in protocol.SERVED_NAMESPACES:
        return None
    from torch._library.custom_ops import OPDEFS

    definition = OPDEFS.get(f"{func.namespace}::{func._opname}")
    if definition is None:
        return None
    implementations = definition._backend_fns
    implementation = implementations.get("cpu") or implementations.get(None)  # the host's choice
    if implementation is None:
        return None

    def run(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        with device_mode_active():  # it makes tensors with device=input.device
            return implementation(*args, **kwargs)

    return run


device_mode: list[Any] = []
"""The torch-function mode placing tensors on the proxied devices, once installed (mode.py)."""


def under_device_mode(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` with the device mode on this thread's mode stack: torch leaves
    function modes while it dispatches, and threads started in C++ never had it."""
    mode = device_mode[0] if device_mode else None
    if mode is None or mode in torch.overrides._get_current_function_mode_stack():
        return function(*args, **kwargs)
    with mode:
        return function(*args, **kwargs)


def device_mode_active() -> Any:
    """A context in which the device mode is active (entered unless it is on the mode stack)."""
    from torch.overrides import _get_current_function_mode_stack

    if not device_mode or device_mode[0] in _get_current_function_mode_stack():
        return contextlib.nullcontext()
    return device_mode[0]


def dispatch(func: Any, args: Sequence[Any], kwargs: dict[str, Any] | None) -> Any:
    """Carry out one aten operation on stand-ins (most are forwarded to the proxy server)."""
    try:
        route = _routes[id(func)]  # operators live as long as torch: their ids stay theirs
    except KeyError:
        route = special_ops.get(func)
        if route is None:
            route = next((found for rule in special_rules if (found := rule(func)) is not None), None)
        _routes[id(func)] = route
    if route is None:
        return forward(func, args, kwargs)
    return route(func, args, kwargs or {})


_INFERENCE_MODE = torch.is_inference_mode_enabled
_DEFAULT_DTYPE = torch.get_default_dtype


def forward(func: Any, args: Sequence[Any], kwargs: dict[str, Any] | None) -> Any:
    """Send one aten operation to the server; its outputs as stand-ins.

    A call whose signature was seen before runs its plan (OP_RUN) and is answered from the
    cached template at once; a new signature is planned (OP_PLAN) and asks for its template.
    """
    try:
        call = encoding.encode_call(args, kwargs)
    except encoding.LargeHostTensor:
        target = _first_stand_in([*args, *(kwargs or {}).values()])
        assert target is not None
        args = _upload_large_host_tensors(list(args), target._channel)
        kwargs = {k: _upload_large_host_tensors(v, target._channel) for k, v in (kwargs or {}).items()}
        call = encoding.encode_call(args, kwargs)
    inputs = call.inputs
    channel = inputs[0]._channel
    for stand_in in inputs:
        if stand_in._channel is not channel:
            raise same_device_error(str(channel.device), str(stand_in._channel.device))
    if call.host_tensors:
        first = channel.attach([raw for _, raw in call.host_tensors])
        for position, (payload, _raw) in enumerate(call.host_tensors):
            payload[3] = first + position
    default_dtype = _DEFAULT_DTYPE()
    channel.follow_settings(default_dtype)
    if default_dtype is torch.float32:
        key: tuple[Any, ...] = (id(func), tuple(call.signature))
    else:
        key = (id(func), tuple(call.signature), default_dtype)
    known = channel.calls.get(key)
    if known is None:
        known = channel.plan(key, func, *encoding.plan_arguments(args, kwargs))
    else:
        template = known[1]
        if template is not None and known[3] < channel.sync_bytes:
            first = channel.new_handle(known[2])
            channel.push([protocol.OP_RUN, known[0], first, call.values])
            viewed = known[4]
            if template[0] == protocol.TEMPLATE_TENSOR and (viewed is None or not _INFERENCE_MODE()):
                out = new_stand_in(channel, first, template[1])
                if viewed is not None:
                    out._storage = storage_record(args[viewed])
                return out
            return _outputs(template, channel, inputs, first, viewed, args)
    first = channel.next_handle
    try:
        reply = channel.request([protocol.REQ_RUN, known[0], first, call.values])
    except BaseException:
        if known[1] is None:  # the plan may have been refused: the next call plans it again
            channel.calls.pop(key, None)
        raise
    template = _parse_template(reply)
    count, nbytes, depends_on_values = _count_new(template)
    channel.next_handle = first + count
    if len(known) == 4:
        viewed = viewed_argument(func)
        viewing = viewed is not None and viewed < len(args) and isinstance(args[viewed], ProxyTensor)
        known.append(viewed if viewing else None)
    if not depends_on_values and not _value_dependent(func, args):
        known[1:4] = [template, count, nbytes]
    return _outputs(template, channel, inputs, first, known[4], args)


def _outputs(
    template: Any, channel: Channel, inputs: list[ProxyTensor], first: int, viewed: int | None, args: Any
) -> Any:
    """An operation's outputs built from its template (new handles from `first`), recorded as views
    of argument `viewed`'s storage if not None, and made as torch makes such views."""
    if viewed is None:
        return _build(template, channel, inputs, [first])
    with _view_context(args[viewed]):
        outputs = _build(template, channel, inputs, [first])
    share_storage(outputs, args[viewed])
    return outputs


_NO_CONTEXT = contextlib.nullcontext()


def _view_context(base: ProxyTensor) -> Any:
    """Where the stand-in of a view of `base` is made: outside inference mode when in it `base` is
    a normal tensor. The view is a normal tensor then, which torch gives `base`'s version counter,
    and a stand-in made inside inference mode is an inference tensor, which refuses it."""
    if _INFERENCE_MODE() and not base.is_inference():
        return torch.inference_mode(False)
    return _NO_CONTEXT


# -- printing ------------------------------------------------------------------------------------
def _repr(stand_in: ProxyTensor) -> str:
    """What torch prints for a cuda tensor with these values."""
    from torch import _tensor_str

    with torch.no_grad():
        host = download(stand_in)
    if host.layout != torch.strided:  # torch prints the components, then the device before the size
        return repr(host).replace("size=", f"device='{stand_in.device}', size=", 1)
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


from . import encoding  # noqa: E402 (it is given ProxyTensor from here)

encoding.use_stand_in_class(ProxyTensor)
