# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""The torch-function mode that places tensors on the proxied devices.

Installed globally, it makes the tensors of factories called with `device="cuda..."` on the
devices, hands the methods it takes over to their handlers (method_handlers.py), raises what
CUDA raises when a call from the program mixes devices (device_checks.py), and runs torch's own
Python functions with the mode active, so that the tensors they make land on the devices too.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from types import CodeType, FunctionType
from typing import Any

import torch
import torch.utils._device
from torch.overrides import TorchFunctionMode, handle_torch_function
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import protocol
from .channel import CLIENT_LOCK
from .device_checks import (
    CHECKED_INSIDE_TORCH,
    HOST_FROM,
    LISTS_OF_TENSORS,
    MIXING_ALLOWED,
    called_by_client,
    check_devices,
    is_cuda,
)
from .devices import DEVICES, device_index
from .encoding import wire_arguments
from .method_handlers import (
    FILLED_LIKE,
    FROM_VALUES,
    HOST_PLACEABLE,
    METHOD_HANDLERS,
    from_stand_in_to_host,
    host_values,
    made_on_host,
    made_pinned,
    with_parts_changed,
)
from .randomness import DeviceDefaultGenerator
from .tensor import ProxyTensor, new_stand_in
from .transfers import to_device, upload

_Tensor = torch.Tensor


_SERVER_FACTORIES = {getattr(torch, name) for name in protocol.SERVER_FACTORIES}
_DEFAULT_DEVICE = torch.utils._device
"""Where `torch.set_default_device` and `with torch.device(...)` keep the default device (CURRENT_DEVICE)."""
_DEFAULT_PLACED = frozenset(torch.utils._device._device_constructors())
"""The factories that make their tensors on the default device when not given one."""
_DEVICE_CONTEXT_FUNCTION = torch.utils._device.DeviceContext.__torch_function__


def _device_context_function(
    self: Any, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
) -> Any:
    """torch's DeviceContext, which gives factories the default device, except a cuda one to the
    host tensors the client itself makes (`torch.set_default_device` puts it beneath every other
    mode, so it sees those too, and they would reach the real CUDA)."""
    if self.device.type == "cuda" and called_by_client(sys._getframe(1)):
        return func(*args, **(kwargs or {}))
    return _DEVICE_CONTEXT_FUNCTION(self, func, types, args, kwargs)


def follow_default_device() -> None:
    """Apply a cuda default device (`torch.set_default_device`, `with torch.device(...)`) to the
    program's factories only, not to the host tensors the client makes."""
    torch.utils._device.DeviceContext.__torch_function__ = _device_context_function  # type: ignore[method-assign]


def _factory_of_parts(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`torch.empty_like(x, device="cuda")` and kin of a subclass made of tensors (a meta DTensor
    moved by `module.to_empty`): each part made on the device, wrapped again as x wraps its own."""
    options = dict(kwargs)
    requires_grad = bool(options.pop("requires_grad", False))
    made = with_parts_changed(args[0], lambda part: _factory(func, [part, *args[1:]], options)).detach()
    return made.requires_grad_(True) if requires_grad else made


def _factory(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """A tensor-making call with device='cuda...': made by the server, or on the host and uploaded."""
    if args and func in FILLED_LIKE and is_traceable_wrapper_subclass(args[0]):  # a DTensor
        return _factory_of_parts(func, args, kwargs)
    index = device_index(kwargs["device"])
    options = dict(kwargs)
    if args and isinstance(args[0], ProxyTensor) and args[0]._channel.index == index:
        options.pop("device")
        return func(*args, **options)
    options.pop("pin_memory", None)
    requires_grad = bool(options.pop("requires_grad", False))
    if func in _SERVER_FACTORIES and not any(isinstance(a, torch.Tensor) for a in (*args, *options.values())):
        options["device"] = "meta"
        meta = func(*args, **options)
        channel = DEVICES.channel(index)
        channel.follow_settings(torch.get_default_dtype())
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


def _names_host(device: Any) -> bool:
    """Whether a device argument is given and names the host."""
    return device is not None and not is_cuda(device)


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
        if func in FROM_VALUES and args:
            if type(args[0]) in (list, tuple):
                with CLIENT_LOCK:
                    args = (host_values(args[0]), *args[1:])
            elif type(args[0]) is ProxyTensor and kwargs and _names_host(kwargs.get("device")):
                with CLIENT_LOCK:
                    return from_stand_in_to_host(func, args[0], kwargs)
        inside = _IN_MODE.get(func)
        if inside is not None:
            with CLIENT_LOCK, self:
                return inside(func, args, kwargs or {})
        handler = METHOD_HANDLERS.get(func)
        if handler is not None:
            with CLIENT_LOCK:
                return handler(func, args, kwargs or {})
        default = _DEFAULT_DEVICE.CURRENT_DEVICE
        if (
            default is not None
            and default.type == "cuda"
            and func in _DEFAULT_PLACED
            and (not kwargs or kwargs.get("device") is None)
            and not called_by_client(sys._getframe(1))
        ):
            kwargs = {**(kwargs or {}), "device": default}
        if kwargs:
            if type(kwargs.get("generator")) is DeviceDefaultGenerator:
                kwargs = {**kwargs, "generator": torch.default_generator}
            device = kwargs.get("device")
            if kwargs.get("pin_memory") and (device is None or not is_cuda(device)):
                return made_pinned(func, args, kwargs)
            if device is not None and is_cuda(device):
                with CLIENT_LOCK:
                    return _factory(func, args, kwargs)
            if device is not None and func in HOST_PLACEABLE and isinstance(args[0], ProxyTensor):
                with CLIENT_LOCK:
                    return made_on_host(func, args, kwargs)
        if len(args) > 1 or func in LISTS_OF_TENSORS:
            if func in CHECKED_INSIDE_TORCH:  # torch passes some of their tensors by keyword
                check_devices((*args, *kwargs.values()) if kwargs else args, inside_torch_too=True)
            elif func not in MIXING_ALLOWED:
                check_devices(args[: HOST_FROM.get(func, len(args))])
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
