# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""The torch-function mode that places tensors on the proxied devices.

Installed globally, it routes factories called with `device="cuda..."`, `.to`, `.cuda`,
`.cpu`, `.numpy`, `.tolist` and `.new_tensor` to stand-ins and transfers, and raises what
CUDA raises when a call from the program mixes cuda and host tensors (with stand-ins, whose
C++ device is the host, torch itself would not notice).
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from types import CodeType, FunctionType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, handle_torch_function
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import legacy_types, protocol
from .channel import CLIENT_LOCK
from .devices import DEVICES, device_index, same_device_error
from .encoding import wire_arguments
from .serialization import EXPORT_REFUSED, refuse_export
from .tensor import ProxyTensor, download, new_stand_in, stand_for
from .transfers import to_device, to_host, upload

_Tensor = torch.Tensor
_PACKAGE = __name__.rsplit(".", 1)[0]


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _caller_module() -> str:
    """The module of the torch function's caller: the first frame outside this package."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        if not name.startswith(_PACKAGE) and name != "torch.overrides":
            return name
        frame = frame.f_back
    return ""


def _from_torch_internals() -> bool:
    """Whether the caller of the torch function is torch's own Python code."""
    return _caller_module().startswith("torch.")


_KEEPS_ON_HOST = (
    "torch.distributed._state_dict_utils",
    "torch.distributed.checkpoint",
    "torch.nn.modules.module",
)
"""torch's own modules whose `.to("cpu")` means host memory, as the program's does: they offload
state dicts to keep or save them, or move a module where the program asks (`Module.to("cpu")`),
not group tensors by their C++ device."""


def _as_device(value: Any) -> Any:
    """A device index (an int, as in `tensor.to(1)`) as the cuda device it names; else the value."""
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.device("cuda", value)
    return value


def _to(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`Tensor.to`: stand-ins for cuda targets, host copies for the program's cpu targets."""
    self: Any = args[0]
    options = dict(kwargs)
    copy = bool(options.pop("copy", False))
    device, dtype, _non_blocking, memory_format = _parse_to(torch._C._nn._parse_to, args[1:], options)
    is_stand_in = isinstance(self, ProxyTensor)
    if device is None or device.type not in ("cuda", "cpu"):
        return func(*args, **kwargs)
    if device.type == "cuda":
        index = DEVICES.current if device.index is None else device.index
        already_there = (
            self._channel.index == index
            if is_stand_in
            else self.device == torch.device("cuda", index) and is_traceable_wrapper_subclass(self)
        )  # a DTensor of stand-ins is on its parts' device
        if already_there:
            if dtype is None and not copy and memory_format in (None, torch.preserve_format):
                return self
            return func(
                self,
                dtype=dtype or self.dtype,
                copy=copy,
                memory_format=memory_format or torch.preserve_format,
            )
        source = to_host(self) if is_stand_in else self
        if dtype is not None and dtype != source.dtype:
            source = source.to(dtype)
        return to_device(source, index)
    if not is_stand_in:
        return func(*args, **kwargs)
    caller = _caller_module()
    if caller.startswith("torch.") and not caller.startswith(_KEEPS_ON_HOST):
        # torch groups tensors by their C++ device, which is the host for stand-ins
        if dtype is None or dtype == self.dtype:
            return self.clone() if copy else self
        return func(self, dtype=dtype, copy=copy)
    out = to_host(self)
    if dtype is not None and dtype != out.dtype:
        out = out.to(dtype)
    return out


_GROUP_BY_DEVICE_AND_DTYPE = torch._C._group_tensors_by_device_and_dtype


def _grouped_by_device_and_dtype(tensorlistlist: list[list[Any]], with_indices: bool = False) -> Any:
    """`torch._C._group_tensors_by_device_and_dtype` (optimizers' foreach and fused steps,
    `clip_grad_norm_`, averaged models): stand-ins grouped by the device they are on, as a GPU's
    tensors are, not by their C++ device, which is the host for all of them (the groups of a
    model split over two devices were then stepped and scaled as if on one)."""
    first = tensorlistlist[0] if tensorlistlist else ()
    if not any(type(tensor) is ProxyTensor for tensor in first):
        return _GROUP_BY_DEVICE_AND_DTYPE(tensorlistlist, with_indices)
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[list[Any]], list[int]]] = {}
    for index, tensor in enumerate(first):
        key = (tensor.device, tensor.dtype)
        group = groups.get(key)
        if group is None:
            group = groups[key] = ([[] for _ in tensorlistlist], [])
        for grouped, tensors in zip(group[0], tensorlistlist, strict=True):
            if tensors:  # an empty list (an optimizer's unused state) stays empty in every group
                grouped.append(tensors[index])
        if with_indices:
            group[1].append(index)
    return groups


def group_by_proxied_device() -> None:
    """Make torch group tensors for its multi-tensor kernels by their proxied device."""
    torch._C._group_tensors_by_device_and_dtype = _grouped_by_device_and_dtype  # type: ignore[assignment]


def _parse_to(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`torch._C._nn._parse_to` (behind `Tensor.to` and `Module.to`): a bare int names a cuda device
    here too, and a stand-in given as the example (`x.to(y)`, `Module.to(y)`, by position or as
    `other=`) gives its device, not its C++ one (the host)."""
    options = dict(kwargs)
    if "device" in options:
        options["device"] = _as_device(options["device"])
    targets = [_as_device(arg) for arg in args]
    example = options.pop("other", options.pop("tensor", None))
    if example is not None:
        targets.insert(0, example)
    if targets and isinstance(targets[0], ProxyTensor):
        example = targets[0]
        return (example.device, example.dtype, *func(example, *targets[1:], **options)[2:])
    return func(*targets, **options)


def _cuda(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    self = args[0]
    device = args[1] if len(args) > 1 else kwargs.get("device")
    index = device_index(device)
    if isinstance(self, ProxyTensor) and self._channel.index == index:
        return self
    source = to_host(self) if isinstance(self, ProxyTensor) else self
    return to_device(source, index)


def _device(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`torch.device(0)`: a bare index names the accelerator's device, a cuda one here."""
    if len(args) == 1 and not kwargs:
        return _as_device(args[0]) if isinstance(args[0], int) else func(*args)
    return func(*args, **kwargs)


def _type(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`Tensor.type`: a stand-in is named by its cuda legacy type, and a legacy type (a cuda one, or
    the host's for a stand-in) converts as `.to` does."""
    tensor = args[0]
    spec = args[1] if len(args) > 1 else kwargs.get("dtype")
    is_stand_in = isinstance(tensor, ProxyTensor)
    if spec is None:
        return legacy_types.type_name(tensor) if is_stand_in else func(*args, **kwargs)
    target = legacy_types.type_target(spec)
    if target is None or not (target[0] or is_stand_in):
        return func(*args, **kwargs)
    on_cuda, dtype = target
    device = (tensor.device if is_stand_in else "cuda") if on_cuda else "cpu"
    non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    return _to(_Tensor.to, (tensor,), {"device": device, "dtype": dtype, "non_blocking": non_blocking})


def _cpu(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    if isinstance(args[0], ProxyTensor):
        return to_host(args[0])
    return func(*args, **kwargs)


def _numpy(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    self = args[0]
    if isinstance(self, ProxyTensor):
        force = kwargs.get("force", args[1] if len(args) > 1 else False)
        if force:
            return download(self.detach()).numpy()
        raise TypeError(
            f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to "
            "copy the tensor to host memory first."
        )
    return func(*args, **kwargs)


def _type_as(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`x.type_as(y)`: x as `y.type()` names it, on the host or a device (a stand-in stays on its
    own device, another tensor goes to the current one, as `x.type("torch.cuda.FloatTensor")`)."""
    self, other = args[0], args[1]
    if isinstance(other, ProxyTensor):
        device = self.device if isinstance(self, ProxyTensor) else torch.device("cuda", DEVICES.current)
    elif isinstance(self, ProxyTensor):
        device = torch.device("cpu")
    else:
        return func(*args, **kwargs)
    return _to(_Tensor.to, (self,), {"device": device, "dtype": other.dtype})


def _host_only(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`apply_`, `map_` and `map2_`, which call Python on each element in place: refused for device
    tensors with CUDA's error (run on the wrapper they would write through its empty storage)."""
    if any(isinstance(arg, ProxyTensor) for arg in args[:3]):
        raise TypeError(f"{func.__name__} is only implemented on CPU tensors")
    return func(*args, **kwargs)


def _export(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`__dlpack__` and `__cuda_array_interface__` of a stand-in: refused (serialization.py); the
    interface's absence is an AttributeError, so that libraries asking `hasattr` take another way."""
    if isinstance(args[0], ProxyTensor):
        if func == _CUDA_ARRAY_INTERFACE:
            raise AttributeError(EXPORT_REFUSED)
        refuse_export(args[0])
    return func(*args, **kwargs)


_CUDA_ARRAY_INTERFACE = _Tensor.__cuda_array_interface__.__get__  # type: ignore[attr-defined]


def _tolist(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    if isinstance(args[0], ProxyTensor):
        return download(args[0].detach()).tolist()
    return func(*args, **kwargs)


_MADE_BY_METHOD = frozenset(
    {_Tensor.new_tensor, _Tensor.new_empty, _Tensor.new_zeros, _Tensor.new_ones, _Tensor.new_full}
)
"""Methods that make a tensor of their tensor's dtype, placed where their `device` says."""
_FILLED_LIKE = frozenset({torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like})
"""The functions making a tensor like a given one, empty or of one value: made part by part, a
subclass's parts are what the whole would be (random ones are not: a DTensor draws by its own rules)."""
_HOST_PLACEABLE = _MADE_BY_METHOD | _FILLED_LIKE | {torch.rand_like, torch.randn_like, torch.randint_like}
"""Those methods and the functions that make a tensor like a given one (its layout and dtype)."""


def _made_on_host(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`x.new_zeros(n, device="cpu")`, `torch.zeros_like(x, device="cpu")` and the like of a stand-in
    x: made on the host as CUDA makes them, from a host tensor with x's layout and dtype (the data
    of `new_tensor` brought to the host first)."""
    like = args[0]
    if func in _MADE_BY_METHOD:
        host_like = torch.empty(0, dtype=like.dtype)  # only its dtype counts
    else:
        host_like = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype)
    rest = [download(arg.detach()) if isinstance(arg, ProxyTensor) else arg for arg in args[1:]]
    return func(host_like, *rest, **kwargs)


def _new_tensor(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    self = args[0]
    device = kwargs.get("device")
    if device is not None and not _is_cuda(device):
        return _made_on_host(func, args, kwargs) if isinstance(self, ProxyTensor) else func(*args, **kwargs)
    if isinstance(self, ProxyTensor) or device is not None:
        index = self._channel.index if device is None else device_index(device)
        options = dict(kwargs)
        options.pop("device", None)
        requires_grad = options.pop("requires_grad", False)
        options.setdefault("dtype", self.dtype)
        data = args[1]
        if isinstance(data, ProxyTensor):
            data = download(data.detach())
        host = (
            torch.tensor(data, **options)
            if not isinstance(data, torch.Tensor)
            else data.detach().to(options["dtype"])
        )
        out = upload(host, index)
        if requires_grad:
            out.requires_grad_(True)
        return out
    return func(*args, **kwargs)


def _set_data(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`tensor.data = value` on stand-ins: the tensor stands for value's server tensor from then on
    (torch itself changes only the wrapper's C++ metadata, which would leave it naming the old one)."""
    self, value = args
    if type(self) is ProxyTensor and type(value) is ProxyTensor:
        func(self, value)
        stand_for(self, value)
        return None
    _check_devices(args)
    return func(*args, **kwargs)


_FROM_VALUES = frozenset({torch.tensor, torch.as_tensor, torch.asarray})
"""Functions making a tensor from nested sequences of values, which may hold device scalars."""


def _host_values(data: Any) -> Any:
    """Nested lists and tuples with every stand-in in them replaced by its host copy, as torch reads
    a GPU tensor's value where it meets one (`torch.tensor([loss_a, loss_b])`); `data` itself when it
    holds none."""
    if isinstance(data, ProxyTensor):
        return download(data.detach())
    if type(data) is list or type(data) is tuple:
        items = [_host_values(item) for item in data]
        if any(new is not old for new, old in zip(items, data, strict=True)):
            return items
    return data


_PINNED: set[int] = set()
"""Addresses of the host storages made "pinned" (`pin_memory()`, `pin_memory=True`): there is no
page-locked memory to give on virtual devices, nor any need of it, but a GPU says they are pinned."""


def _mark_pinned(tensor: torch.Tensor) -> torch.Tensor:
    """Count the tensor's storage as pinned while the tensor lives."""
    address = tensor.untyped_storage().data_ptr()
    if address not in _PINNED:
        _PINNED.add(address)
        weakref.finalize(tensor, _PINNED.discard, address)
    return tensor


def _pin_memory(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`x.pin_memory()`: x itself, counted as pinned (a stand-in is returned as it is)."""
    return args[0] if isinstance(args[0], ProxyTensor) else _mark_pinned(args[0])


def _is_pinned(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    self = args[0]
    return not isinstance(self, ProxyTensor) and self.untyped_storage().data_ptr() in _PINNED


def _made_pinned(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """A host tensor made with `pin_memory=True` (`torch.empty(n, pin_memory=True)`): torch refuses
    that without a CUDA build, so it is made unpinned and counted as pinned. (Calls torch makes
    inside an operation, such as autograd's `save_on_cpu` hooks, do not reach the mode.)"""
    return _mark_pinned(func(*args, **{**kwargs, "pin_memory": False}))


_SERVER_FACTORIES = {getattr(torch, name) for name in protocol.SERVER_FACTORIES}


def _factory_of_parts(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`torch.empty_like(x, device="cuda")` and kin of a subclass made of tensors (a meta DTensor
    moved by `module.to_empty`): each part made on the device, wrapped again as x wraps its own."""
    outer = args[0]
    options = dict(kwargs)
    requires_grad = bool(options.pop("requires_grad", False))
    names, context = outer.__tensor_flatten__()
    parts = {name: getattr(outer, name) for name in names}
    for name, part in parts.items():
        if isinstance(part, torch.Tensor):  # beside them: what describes the parts (a device mesh)
            parts[name] = _factory(func, [part, *args[1:]], options)
    made = type(outer).__tensor_unflatten__(parts, context, outer.size(), outer.stride()).detach()
    return made.requires_grad_(True) if requires_grad else made


def _factory(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """A tensor-making call with device='cuda...': made by the server, or on the host and uploaded."""
    if args and func in _FILLED_LIKE and is_traceable_wrapper_subclass(args[0]):  # a DTensor
        return _factory_of_parts(func, args, kwargs)
    index = device_index(kwargs["device"])
    options = dict(kwargs)
    if args and isinstance(args[0], ProxyTensor) and args[0]._channel.index == index:
        options.pop("device")
        return func(*args, **options)
    options.pop("pin_memory", None)
    requires_grad = bool(options.pop("requires_grad", False))
    if func in _SERVER_FACTORIES and not any(isinstance(a, torch.Tensor) for a in args):
        options["device"] = "meta"
        meta = func(*args, **options)
        channel = DEVICES.channel(index)
        handle = channel.new_handle()
        wire_args, wire_kwargs = wire_arguments(args, {**options, "device": channel.device})  # the server's
        op = [protocol.OP_FACTORY, handle, func.__name__, wire_args, wire_kwargs]
        nbytes = meta.numel() * meta.element_size()
        if nbytes >= channel.sync_bytes:
            channel.pending.append(op)
            try:
                channel.request([protocol.REQ_SYNC])
            except BaseException:
                channel.freed.append(handle)
                raise
        else:
            channel.push(op)
        out = new_stand_in(channel, handle, (tuple(meta.shape), tuple(meta.stride()), 0, meta.dtype))
    else:
        options["device"] = "cpu"
        local = func(*args, **options)
        if not isinstance(local, torch.Tensor):
            return local
        out = upload(local, index)
    if requires_grad:
        out.requires_grad_(True)
    return out


def _backward(tensors: Any, gradient: Any, retain_graph: Any, create_graph: bool, inputs: Any) -> None:
    """What torch.autograd.backward does, from inside the mode's handler (the engine then keeps the
    mode active in backward hooks and autograd functions, where FSDP and DDP make tensors)."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs or ())
    grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(gradient, len(tensors)), is_grads_batched=False)
    retain = create_graph if retain_graph is None else retain_graph
    _engine_run_backward(
        tensors, grads, retain, create_graph, inputs, allow_unreachable=True, accumulate_grad=True
    )


def _tensor_backward(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    options = dict(zip(("gradient", "retain_graph", "create_graph", "inputs"), args[1:], strict=False))
    options.update(kwargs)
    _backward(args[0], options.get("gradient"), options.get("retain_graph"),
              bool(options.get("create_graph", False)), options.get("inputs"))  # fmt: skip


def _autograd_backward(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    names = ("tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs")
    options = dict(zip(names, args, strict=False))
    options.update(kwargs)
    gradient = (
        options.get("grad_tensors")
        if options.get("grad_tensors") is not None
        else options.get("grad_variables")
    )
    _backward(options["tensors"], gradient, options.get("retain_graph"),
              bool(options.get("create_graph", False)), options.get("inputs"))  # fmt: skip


_IN_MODE: dict[Any, Callable[[Any, Sequence[Any], dict[str, Any]], Any]] = {
    _Tensor.backward: _tensor_backward,
    torch.autograd.backward: _autograd_backward,
}
"""Calls that run with the mode active again (a mode is off while its handler runs)."""

_METHODS: dict[Any, Callable[[Any, Sequence[Any], dict[str, Any]], Any]] = {
    _Tensor.to: _to,
    torch._C._nn._parse_to: _parse_to,
    _Tensor.cuda: _cuda,
    _Tensor.cpu: _cpu,
    _Tensor.numpy: _numpy,
    _Tensor.__array__: _numpy,  # np.array(x), np.asarray(x): a GPU's TypeError, as numpy()'s
    _Tensor.tolist: _tolist,
    _Tensor.type_as: _type_as,
    _Tensor.__dlpack__: _export,
    _CUDA_ARRAY_INTERFACE: _export,
    _Tensor.apply_: _host_only,
    _Tensor.map_: _host_only,
    _Tensor.map2_: _host_only,
    _Tensor.new_tensor: _new_tensor,
    _Tensor.pin_memory: _pin_memory,
    _Tensor.is_pinned: _is_pinned,
    torch._C.TensorBase.data.__set__: _set_data,  # type: ignore[attr-defined]
    _Tensor.type: _type,
    torch.device: _device,
}

_MIXING_ALLOWED = {
    _Tensor.view_as,  # the other tensor gives only its shape
    _Tensor.reshape_as,
    _Tensor.expand_as,
    _Tensor.resize_as_,
    _Tensor.tensor_split,  # indices given as a tensor are on the host, as torch requires
    torch.tensor_split,
    _Tensor.__getitem__,
    _Tensor.__setitem__,
    _Tensor.copy_,
    _Tensor.index_put_,
    _Tensor.index_put,
    torch.index_put,
    _Tensor.__reduce_ex__,
    _Tensor.__deepcopy__,
}
"""Calls that legitimately take host and device tensors together (as they do on CUDA)."""


def _check_devices(args: Sequence[Any]) -> None:
    """Raise what CUDA raises when one call mixes cuda tensors and (non-scalar) host tensors."""
    device = host = None
    channels_differ = False
    for arg in args:
        kind = type(arg)
        if kind is ProxyTensor:
            if device is None:
                device = arg
            elif arg._channel is not device._channel:
                channels_differ = True
        elif kind is list or kind is tuple:
            for item in arg:
                if isinstance(item, ProxyTensor):
                    device = item if device is None else device
                elif isinstance(item, torch.Tensor) and item.dim() > 0:
                    host = item if host is None else host
        elif isinstance(arg, torch.Tensor) and arg.dim() > 0:
            if isinstance(arg, ProxyTensor):
                device = arg if device is None else device
            else:
                host = arg if host is None else host
    if device is None or (host is None and not channels_differ) or _from_torch_internals():
        return
    for arg in args:
        if isinstance(arg, ProxyTensor) and arg._channel is not device._channel:
            raise same_device_error(str(device.device), str(arg.device))
    if host is not None:
        raise same_device_error(str(device.device), str(host.device))


_MAKES_TENSORS = frozenset(
    {
        "device", "cuda", "to", "tensor", "as_tensor", "from_numpy", "empty", "empty_strided",
        "zeros", "ones", "full", "arange", "range", "linspace", "logspace", "eye", "rand", "randn",
        "randint", "randperm", "normal", "scalar_tensor", "tril_indices", "triu_indices",
        "new_tensor", "new_empty", "new_zeros", "new_ones", "new_full", "get_default_device",
    }
)  # fmt: skip
"""Names whose use in a Python function may make a tensor on a device named there."""
_mode_needed: dict[Any, bool] = {}


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def _needs_mode(func: FunctionType, depth: int = 0) -> bool:
    """Whether a torch Python function may make tensors on the devices (then it runs with the mode).

    It does if its code, or that of a function it calls from its own module or its closure,
    names a factory, `device`, `.to` or `.cuda`; F.relu, which only calls torch.relu, does not.
    """
    found = _mode_needed.get(func)
    if found is not None:
        return found
    _mode_needed[func] = False  # recursion guard
    codes = [func.__code__]
    names: set[str] = set()
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes += [c for c in code.co_consts if isinstance(c, CodeType)]
    found = not _MAKES_TENSORS.isdisjoint(names)
    if not found and depth < 3:
        module = func.__globals__
        called = [module.get(name) for name in names]
        called += [cell.cell_contents for cell in func.__closure__ or () if _filled(cell)]
        found = any(type(f) is FunctionType and _needs_mode(f, depth + 1) for f in called)
    _mode_needed[func] = found
    return found


def _never(*args: Any) -> bool:
    return False


_CHECKS_SKIPPED = {
    "has_torch_function": _never,
    "has_torch_function_unary": _never,
    "has_torch_function_variadic": _never,
}
_bodies: dict[Any, FunctionType] = {}


def _body(func: FunctionType) -> FunctionType:
    """A copy of one of torch's Python functions that skips its own torch-function check.

    torch leaves a torch-function mode while the mode handles a call, so the torch calls a
    Python function makes (`torch.rand(..., device=x.device)` in fractional_max_pool2d,
    `torch.tensor(..., device=...)` in unravel_index) would bypass this mode and reach CUDA,
    which a CPU build lacks. The copy runs with the mode entered again; its own check, which
    would hand the call back to the mode forever, is answered "no".
    """
    body = _bodies.get(func)
    if body is None:
        namespace = {**func.__globals__, **_CHECKS_SKIPPED}
        body = FunctionType(func.__code__, namespace, func.__name__, func.__defaults__, func.__closure__)
        body.__kwdefaults__ = func.__kwdefaults__
        _bodies[func] = body
    return body


def _checking_function(frame: Any) -> FunctionType | None:
    """The function that called handle_torch_function from `frame` (handle_torch_function's frame)."""
    if frame.f_code is not handle_torch_function.__code__ or frame.f_back is None:
        return None
    caller = frame.f_back
    found = caller.f_globals.get(caller.f_code.co_name)
    if type(found) is FunctionType and found.__code__ is caller.f_code:
        return found
    return None


class _Entering(threading.local):
    """The Python function whose body the mode is about to run (per thread)."""

    func: Any = None
    checker_tried = False


def _on_device_of(args: Sequence[Any], result: Any) -> Any:
    """`result` with host tensors uploaded, if every tensor argument was a stand-in.

    torch's C++ composites make some results with their input's options (`at::zeros(...,
    input.options())` in matrix_rank of an empty matrix), and a stand-in's options name the
    host; on a GPU such a result is on the device.
    """
    found = [a for a in _tensor_arguments(args)]
    if not found or not all(isinstance(a, ProxyTensor) for a in found):
        return result
    index = found[0]._channel.index

    def place(value: Any) -> Any:
        if isinstance(value, ProxyTensor) or not isinstance(value, _Tensor):
            if isinstance(value, (list, tuple)) and not isinstance(value, _Tensor):
                return type(value)(place(item) for item in value)
            return value
        return to_device(value, index) if value.device.type == "cpu" else value

    return place(result)


def _tensor_arguments(args: Sequence[Any]) -> list[Any]:
    """The tensors among arguments (and in lists and tuples of them)."""
    found = []
    for arg in args:
        if isinstance(arg, _Tensor):
            found.append(arg)
        elif type(arg) is list or type(arg) is tuple:
            found += _tensor_arguments(arg)
    return found


class DeviceMode(TorchFunctionMode):
    """Routes device placement (factories, .to, .cuda, .cpu) to the proxied devices."""

    def __init__(self) -> None:
        super().__init__()
        self._entering = _Entering()

    def _run_body(self, func: FunctionType, args: Sequence[Any], kwargs: dict[str, Any], again: bool) -> Any:
        """Run a torch Python function with this mode active for the calls it makes.

        `again`: the body of `func` handed the call back at once, because the function that
        checks is not `func` itself (`F.fractional_max_pool2d` dispatches to a function that
        checks): that function, the caller of handle_torch_function, runs instead.
        """
        run = func
        if again:
            checker = None if self._entering.checker_tried else _checking_function(sys._getframe(2))
            if checker is None:  # no way to its body with the mode active: run it as torch does
                return func(*args, **kwargs)
            run = checker
        self._entering.func = func
        self._entering.checker_tried = again
        try:
            with self:
                return _body(run)(*args, **kwargs)
        finally:
            self._entering.func = None
            self._entering.checker_tried = False

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        if func in _FROM_VALUES and args and type(args[0]) in (list, tuple):
            with CLIENT_LOCK:
                args = (_host_values(args[0]), *args[1:])
        inside = _IN_MODE.get(func)
        if inside is not None:
            with CLIENT_LOCK, self:
                return inside(func, args, kwargs or {})
        handler = _METHODS.get(func)
        if handler is not None:
            with CLIENT_LOCK:
                return handler(func, args, kwargs or {})
        if kwargs:
            device = kwargs.get("device")
            if kwargs.get("pin_memory") and (device is None or not _is_cuda(device)):
                return _made_pinned(func, args, kwargs)
            if device is not None and _is_cuda(device):
                with CLIENT_LOCK:
                    return _factory(func, args, kwargs)
            if device is not None and func in _HOST_PLACEABLE and isinstance(args[0], ProxyTensor):
                with CLIENT_LOCK:
                    return _made_on_host(func, args, kwargs)
        if len(args) > 1 and func not in _MIXING_ALLOWED:
            _check_devices(args)
        if type(func) is FunctionType and _needs_mode(func):
            entering = self._entering
            again = entering.func is func
            if not again:
                entering.checker_tried = False
            result = self._run_body(func, args, kwargs or {}, again)
        elif kwargs:
            result = func(*args, **kwargs)
        else:
            result = func(*args)  # operations on stand-ins take the lock in their dispatch
        kind = type(result)
        if kind is ProxyTensor or not (kind is _Tensor or kind is tuple or kind is list):
            return result
        with CLIENT_LOCK:
            return _on_device_of(args, result)
