# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""The torch-function mode that places tensors on the proxied devices.

Installed globally, it routes factories called with `device="cuda..."`, `.to`, `.cuda`,
`.cpu`, `.numpy`, `.tolist` and `.new_tensor` to stand-ins and transfers, and raises what
CUDA raises when a call from the program mixes cuda and host tensors (with stand-ins, whose
C++ device is the host, torch itself would not notice).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from . import protocol
from .devices import DEVICES, device_index, same_device_error
from .tensor import ProxyTensor, download, encode_arguments, new_stand_in
from .transfers import to_device, to_host, upload

_Tensor = torch.Tensor
_PACKAGE = __name__.rsplit(".", 1)[0]


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _from_torch_internals() -> bool:
    """Whether the caller of the torch function is torch's own Python code."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith(_PACKAGE) and name != "torch.overrides":
            return bool(name.startswith("torch."))
        frame = frame.f_back
    return False


def _as_device(value: Any) -> Any:
    """A device index (an int, as in `tensor.to(1)`) as the cuda device it names; else the value."""
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.device("cuda", value)
    return value


def _to(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`Tensor.to`: stand-ins for cuda targets, host copies for the program's cpu targets."""
    self = args[0]
    options = dict(kwargs)
    copy = bool(options.pop("copy", False))
    targets = [_as_device(arg) for arg in args[1:]]  # an int is an accelerator's index
    if "device" in options:
        options["device"] = _as_device(options["device"])
    device, dtype, _non_blocking, memory_format = torch._C._nn._parse_to(*targets, **options)
    is_stand_in = isinstance(self, ProxyTensor)
    if device is None or device.type not in ("cuda", "cpu"):
        return func(*args, **kwargs)
    if device.type == "cuda":
        index = DEVICES.current if device.index is None else device.index
        if is_stand_in and self._channel.index == index:
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
    if _from_torch_internals():
        # torch groups tensors by their C++ device, which is the host for stand-ins
        if dtype is None or dtype == self.dtype:
            return self.clone() if copy else self
        return func(self, dtype=dtype, copy=copy)
    out = to_host(self)
    if dtype is not None and dtype != out.dtype:
        out = out.to(dtype)
    return out


def _cuda(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    self = args[0]
    device = args[1] if len(args) > 1 else kwargs.get("device")
    index = device_index(device)
    if isinstance(self, ProxyTensor) and self._channel.index == index:
        return self
    source = to_host(self) if isinstance(self, ProxyTensor) else self
    return to_device(source, index)


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


def _tolist(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    if isinstance(args[0], ProxyTensor):
        return download(args[0].detach()).tolist()
    return func(*args, **kwargs)


def _new_tensor(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    self = args[0]
    device = kwargs.get("device")
    if isinstance(self, ProxyTensor) or (device is not None and _is_cuda(device)):
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


def _pin_memory(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    return args[0]


def _is_pinned(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    return False


_SERVER_FACTORIES = {getattr(torch, name) for name in protocol.SERVER_FACTORIES}


def _factory(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """A tensor-making call with device='cuda...': made by the server, or on the host and uploaded."""
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
        encoded = encode_arguments(args, {**options, "device": channel.device})  # the server's device
        op = [protocol.OP_FACTORY, handle, func.__name__, encoded.args, encoded.kwargs]
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
    _Tensor.cuda: _cuda,
    _Tensor.cpu: _cpu,
    _Tensor.numpy: _numpy,
    _Tensor.tolist: _tolist,
    _Tensor.new_tensor: _new_tensor,
    _Tensor.pin_memory: _pin_memory,
    _Tensor.is_pinned: _is_pinned,
}

_MIXING_ALLOWED = {
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
    for arg in args:
        kind = type(arg)
        if kind is list or kind is tuple:
            for item in arg:
                if isinstance(item, ProxyTensor):
                    device = item if device is None else device
                elif isinstance(item, torch.Tensor) and item.dim() > 0:
                    host = item if host is None else host
        elif kind is ProxyTensor:
            device = arg if device is None else device
        elif isinstance(arg, torch.Tensor) and arg.dim() > 0 and not isinstance(arg, ProxyTensor):
            host = arg if host is None else host
    if device is None or _from_torch_internals():
        return
    for arg in args:
        if isinstance(arg, ProxyTensor) and arg._channel is not device._channel:
            raise same_device_error(str(device.device), str(arg.device))
    if host is not None:
        raise same_device_error(str(device.device), str(host.device))


class DeviceMode(TorchFunctionMode):
    """Routes device placement (factories, .to, .cuda, .cpu) to the proxied devices."""

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        again = _IN_MODE.get(func)
        if again is not None:
            with self:
                return again(func, args, kwargs or {})
        handler = _METHODS.get(func)
        if handler is not None:
            return handler(func, args, kwargs or {})
        if kwargs:
            device = kwargs.get("device")
            if device is not None and _is_cuda(device):
                return _factory(func, args, kwargs)
        if len(args) > 1 and func not in _MIXING_ALLOWED:
            _check_devices(args)
        if kwargs:
            return func(*args, **kwargs)
        return func(*args)
