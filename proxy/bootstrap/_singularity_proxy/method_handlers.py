# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""The handlers of the tensor methods and functions the device mode (mode.py) takes over by name.

Placement (`to`, `cuda`, `cpu`, `type`, `type_as`, `torch.device(0)`), reading values (`numpy`,
`tolist`, torch.tensor of device scalars), tensors made like a stand-in on the host, `.data =`,
pinned memory, refused exports (DLPack, `apply_`), and torch's grouping of tensors by device: each
does for a stand-in what CUDA does for its tensors.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import legacy_types
from .device_checks import check_devices, is_cuda
from .devices import DEVICES, device_index
from .serialization import EXPORT_REFUSED, refuse_export
from .tensor import ProxyTensor, download, stand_for
from .transfers import to_device, to_host, upload

_Tensor = torch.Tensor


def _as_device(value: Any) -> Any:
    """A device index (an int, as in `tensor.to(1)`) as the cuda device it names; else the value."""
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.device("cuda", value)
    return value


def _to(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`Tensor.to`: stand-ins for cuda targets, host copies for cpu targets (whoever asks: torch
    groups tensors by their proxied device, `_grouped_by_device_and_dtype`, so its own `.to("cpu")`
    means the host too)."""
    self: Any = args[0]
    options = dict(kwargs)
    copy = bool(options.pop("copy", False))
    device, dtype, _non_blocking, memory_format = _parse_to(torch._C._nn._parse_to, args[1:], options)
    is_stand_in = isinstance(self, ProxyTensor)
    if device is None or device.type not in ("cuda", "cpu"):
        return func(*args, **kwargs)
    if _IS_LAZY(self):
        return _lazy_to(func, self, device, dtype)
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
        if not is_stand_in and is_traceable_wrapper_subclass(self):
            return _parts_to(self, torch.device("cuda", index), dtype, copy)
        source = to_host(self) if is_stand_in else self
        if dtype is not None and dtype != source.dtype:
            source = source.to(dtype)
        return to_device(source, index)
    if not is_stand_in:
        return func(*args, **kwargs)
    out = to_host(self)
    if dtype is not None and dtype != out.dtype:
        out = out.to(dtype)
    return out


def with_parts_changed(outer: Any, change: Callable[[torch.Tensor], Any]) -> Any:
    """A subclass made of tensors (a DTensor) with `change` applied to each of its tensor parts,
    wrapped again as it wraps its own (what describes the parts, a device mesh, kept)."""
    names, context = outer.__tensor_flatten__()
    parts = {name: getattr(outer, name) for name in names}
    for name, part in parts.items():
        if isinstance(part, torch.Tensor):
            parts[name] = change(part)
    return type(outer).__tensor_unflatten__(parts, context, outer.size(), outer.stride())


def _parts_to(outer: Any, device: torch.device, dtype: Any, copy: bool) -> Any:
    """`.to("cuda")` of a subclass made of tensors (a DTensor whose local part is on the host, as
    FSDP2's CPU offloading keeps it): each part moved, wrapped again as the subclass wraps its own.
    A DTensor's own `.to` would copy its host part with the host's kernel, which has no CUDA."""
    options = {"device": device, "dtype": dtype, "copy": copy}
    moved = with_parts_changed(outer, lambda part: _to(_Tensor.to, (part,), options))
    return moved.requires_grad_(True) if outer.requires_grad and moved.is_leaf else moved


_IS_LAZY = torch.nn.parameter.is_lazy
_UNINITIALIZED: Any = torch.nn.parameter.UninitializedTensorMixin  # type: ignore[attr-defined]
_MATERIALIZE = _UNINITIALIZED.materialize


def _lazy_to(func: Any, tensor: Any, device: torch.device, dtype: Any) -> Any:
    """`.to` of a lazy module's uninitialised parameter or buffer: it has no data to move, so it
    notes the device it is to be made on (`_proxied_device`, None for the host), as a GPU's
    uninitialised parameter takes the device of the `.to`."""
    target = torch.device("cuda", device_index(device)) if device.type == "cuda" else None
    tensor._proxied_device = target
    out = tensor if dtype is None else func(tensor, dtype=dtype)
    out._proxied_device = target
    return out


def _materialize(self: Any, shape: Any, device: Any = None, dtype: Any = None) -> None:
    """`UninitializedParameter.materialize` (a lazy module's first forward): on the device its
    module was moved to, the parameter becomes a device tensor in place (swapped, as the data setter
    swaps), since a host tensor cannot take a stand-in's data."""
    target = getattr(self, "_proxied_device", None) if device is None else torch.device(device)
    if target is None or target.type != "cuda":
        return _MATERIALIZE(self, shape, device, dtype)  # type: ignore[no-any-return]
    _swap_in_data(self, to_device(torch.empty(shape, dtype=dtype or self.data.dtype), device_index(target)))
    return None


def materialize_lazy_modules_on_devices() -> None:
    """Let lazy modules moved to a proxied device make their parameters there."""
    _UNINITIALIZED.materialize = _materialize


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
    if not isinstance(self, ProxyTensor) and is_traceable_wrapper_subclass(self):
        return _to(_Tensor.to, (self,), {"device": torch.device("cuda", index)})
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
FILLED_LIKE = frozenset({torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like})
"""The functions making a tensor like a given one, empty or of one value: made part by part, a
subclass's parts are what the whole would be (random ones are not: a DTensor draws by its own rules)."""
HOST_PLACEABLE = _MADE_BY_METHOD | FILLED_LIKE | {torch.rand_like, torch.randn_like, torch.randint_like}
"""Those methods and the functions that make a tensor like a given one (its layout and dtype)."""


def made_on_host(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
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
    if device is not None and not is_cuda(device):
        return made_on_host(func, args, kwargs) if isinstance(self, ProxyTensor) else func(*args, **kwargs)
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
    (torch itself changes only the wrapper's C++ metadata, which would leave it naming the old one).
    Between the host and a device (`p.data = p.data.to("cuda")`, `Module.to`, FSDP moving a host
    module), the tensor object is swapped with one of the other kind holding value's data: it keeps
    its identity (a Parameter stays the optimizer's), as the data setter keeps it on a GPU."""
    self, value = args
    is_stand_in, value_is_stand_in = type(self) is ProxyTensor, type(value) is ProxyTensor
    if is_stand_in and value_is_stand_in:
        func(self, value)
        stand_for(self, value)
        return None
    if is_stand_in != value_is_stand_in and isinstance(value, _Tensor) and value.layout == torch.strided:
        _swap_in_data(self, value)
        return None
    if is_stand_in or value_is_stand_in:
        check_devices(args)
    return func(*args, **kwargs)


_STAND_IN_STATE = frozenset({"_handle", "_id", "_meta", "_channel", "_storage", "_is_param"})
"""Attributes that belong to a tensor's kind (a stand-in's server tensor, a subclass Parameter's
mark), not to the program: they stay with the data when a tensor is swapped."""


def _swap_in_data(tensor: Any, value: Any) -> None:
    """Make `tensor` hold `value`'s data by swapping it with a tensor of value's kind. What the
    program gave the tensor stays with it, as the data setter keeps it on a GPU: its gradient,
    requires_grad, for a Parameter its class, its Python attributes (`p._no_weight_decay`) and its
    gradient hooks (registered on the C++ tensor, which the swap exchanges, so registered again)."""
    attributes = {key: item for key, item in vars(tensor).items() if key not in _STAND_IN_STATE}
    hooks, accumulated_hooks = tensor._backward_hooks, tensor._post_accumulate_grad_hooks
    grad = tensor.grad
    replacement = value.detach()
    if isinstance(tensor, torch.nn.Parameter) or getattr(tensor, "_is_param", False):
        replacement = torch.nn.Parameter(replacement, requires_grad=tensor.requires_grad)
    else:
        replacement.requires_grad_(tensor.requires_grad)
    if grad is not None:
        tensor.grad = None  # a gradient held raises the tensor's use count, which swapping checks
    if not _swappable(tensor):
        tensor.grad = grad
        raise RuntimeError(
            "proxy: `tensor.data = other` cannot move a tensor between the host and a proxied device "
            "while other tensors view it (FSDP1's `offload_to_cpu` of its flat parameters does so): "
            "the tensor must become another object here; keep it on its device"
        )
    torch.utils.swap_tensors(tensor, replacement)
    vars(tensor).update(attributes)
    if hooks:
        tensor._backward_hooks = hooks
    if accumulated_hooks:
        tensor._post_accumulate_grad_hooks = accumulated_hooks
    if grad is not None:
        tensor.grad = grad


_COMPATIBLE_SHALLOW_COPY_TYPE = torch._has_compatible_shallow_copy_type


def _compatible_shallow_copy_type(input: Any, from_: Any) -> bool:
    """`torch._has_compatible_shallow_copy_type`, which `Module._apply` asks to choose the data
    setter (keeping each Parameter) over a new Parameter: yes between host and device tensors too,
    as between a CPU's and a GPU's (the setter swaps those, above), where swapping can be done.
    Its parameters keep torch's names, which torch.compile checks."""
    if (type(input) is ProxyTensor) != (type(from_) is ProxyTensor):
        strided = input.layout == torch.strided and from_.layout == torch.strided
        return bool(strided and _swappable(input))
    return _COMPATIBLE_SHALLOW_COPY_TYPE(input, from_)


def _swappable(tensor: Any) -> bool:
    """Whether `torch.utils.swap_tensors` takes the tensor (its own test): nothing else holds it,
    autograd's accumulator aside (the old `weight_norm`'s cached weight holds its parameters; `Module.to`
    then gives them new Parameters, as torch does for tensors of incompatible kinds)."""
    count = tensor._use_count()
    if count <= 1:
        return True
    if count > 2 or not tensor.is_leaf or not tensor.requires_grad:
        return False
    accumulator = torch.autograd.graph.get_gradient_edge(tensor).node  # made now if it was not there
    return bool(tensor._use_count() == 2 and accumulator is not None)


def move_modules_by_data_setter() -> None:
    """Let `Module.to` and kin move parameters between host and devices through the data setter,
    as on a GPU, rather than swapping every parameter (which `load_state_dict` would then do too)."""
    torch._has_compatible_shallow_copy_type = _compatible_shallow_copy_type  # type: ignore[assignment]


FROM_VALUES = frozenset({torch.tensor, torch.as_tensor, torch.asarray})
"""Functions making a tensor from nested sequences of values, which may hold device scalars."""


def from_stand_in_to_host(func: Any, data: Any, kwargs: dict[str, Any]) -> Any:
    """`torch.as_tensor(x, device="cpu")` (`torch.asarray`, `torch.tensor`) of a stand-in x: x moved
    to the host as `x.to(...)` moves it (`torch.tensor` copies a detached x), as of a GPU tensor
    (RNNs' `pack_padded_sequence` takes its lengths so)."""
    options = {name: kwargs[name] for name in ("device", "dtype") if kwargs.get(name) is not None}
    return _to(_Tensor.to, (data.detach() if func is torch.tensor else data,), options)


def host_values(data: Any) -> Any:
    """Nested lists and tuples with every stand-in in them replaced by its host copy, as torch reads
    a GPU tensor's value where it meets one (`torch.tensor([loss_a, loss_b])`); `data` itself when it
    holds none."""
    if isinstance(data, ProxyTensor):
        return download(data.detach())
    if type(data) is list or type(data) is tuple:
        items = [host_values(item) for item in data]
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


def made_pinned(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """A host tensor made with `pin_memory=True` (`torch.empty(n, pin_memory=True)`): torch refuses
    that without a CUDA build, so it is made unpinned and counted as pinned. (Calls torch makes
    inside an operation, such as autograd's `save_on_cpu` hooks, do not reach the mode.)"""
    return _mark_pinned(func(*args, **{**kwargs, "pin_memory": False}))


def _foreach_copy(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`torch._foreach_copy_(destinations, sources)` between host and device tensors: one `copy_`
    per pair, as CUDA's slow path copies across devices (EMA weights stored on the host)."""
    destinations, sources = args[0], args[1]
    mixed = any(
        (type(destination) is ProxyTensor) != (type(source) is ProxyTensor)
        for destination, source in zip(destinations, sources, strict=False)
    )
    if not mixed:
        return func(*args, **kwargs)
    non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    for destination, source in zip(destinations, sources, strict=True):
        destination.copy_(source, non_blocking=non_blocking)
    return None


METHOD_HANDLERS: dict[Any, Callable[[Any, Sequence[Any], dict[str, Any]], Any]] = {
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
    torch._foreach_copy_: _foreach_copy,
}
"""The handlers, by the method or function they take over (the mode calls them holding the client lock)."""
