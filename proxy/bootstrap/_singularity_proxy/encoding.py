# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""The arguments of an operation on stand-ins: its signature, its slot values and its plan.

An operation is known by its *signature*: the operator and what its outputs' layout depends
on (stand-ins' shape, stride, offset and dtype, plain values, the float-ness of top-level
Python floats). The first call of a signature defines a plan on the server (protocol.OP_PLAN):
the arguments in their wire form with {"slot": kind} where the call gives a value that may
change from call to call (a stand-in's handle, a top-level float, a host tensor); every call
then sends only the slot values (OP_RUN). `encode_call` makes the signature and the values
in one pass (the hot path); `plan_arguments` makes the plan's wire form, for the first call.
Both walk the arguments in the same order: positional depth first, then keyword arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import protocol
from .devices import same_device_error

_FLOAT = float
_NAMES = protocol.torch_names()
_TORCH_VALUE_TAGS = _NAMES.encoders
_TENSOR_SLOT = {protocol.TAG_SLOT: protocol.SLOT_TENSOR}
_NUMBER_SLOT = {protocol.TAG_SLOT: protocol.SLOT_NUMBER}
_HOST_SLOT = {protocol.TAG_SLOT: protocol.SLOT_HOST_TENSOR}


class _NoStandIn:
    """What `StandIn` is until tensor.py names the stand-in class (no argument is one)."""


StandIn: type[Any] = _NoStandIn
"""The stand-in class, `tensor.ProxyTensor`. tensor.py imports this module for its hot path and
gives it the class when it loads (`use_stand_in_class`), so that this module does not import it
back."""


def use_stand_in_class(stand_in: type[torch.Tensor]) -> None:
    """Encode instances of `stand_in` as references to server tensors."""
    global StandIn
    StandIn = stand_in


class LargeHostTensor(Exception):
    """A host tensor argument too large to travel inside an operation."""


class Call:
    """One call's signature, slot values, stand-in inputs and host tensors.

    Host tensors are (payload, bytes): the payload is their slot value, whose last element
    becomes the index of their bytes in the frame.
    """

    __slots__ = ("host_tensors", "inputs", "signature", "values")

    def __init__(self) -> None:
        self.signature: list[Any] = []
        self.values: list[Any] = []
        self.inputs: list[Any] = []  # stand-ins
        self.host_tensors: list[tuple[list[Any], memoryview]] = []


def encode_call(args: Sequence[Any], kwargs: dict[str, Any] | None) -> Call:
    """The signature and slot values of a call (the hot path of every operation)."""
    call = Call()
    signature = call.signature
    values = call.values
    inputs = call.inputs
    for arg in args:
        kind = type(arg)
        if kind is StandIn:
            inputs.append(arg)
            signature.append(arg._meta)
            values.append(arg._id)
        elif kind is int or kind is str or arg is None:
            signature.append(arg)
        elif kind is float:
            signature.append(_FLOAT)
            values.append(arg)
        else:
            _encode_other(arg, kind, call, signature)
    if kwargs:
        for name, value in kwargs.items():
            signature.append(name)
            kind = type(value)
            if kind is float:
                signature.append(_FLOAT)
                values.append(value)
            elif kind is int or kind is str or value is None:
                signature.append(value)
            else:
                _encode_other(value, kind, call, signature)
    return call


def _encode_sequence(seq: Sequence[Any], call: Call, signature: list[Any]) -> None:
    """Items of a list argument: stand-ins and host tensors are slots, other values signature."""
    for arg in seq:
        kind = type(arg)
        if kind is StandIn:
            call.inputs.append(arg)
            signature.append(arg._meta)
            call.values.append(arg._id)
        elif kind is int or kind is float or kind is str or arg is None:
            signature.append(arg)
        else:
            _encode_other(arg, kind, call, signature)


def _encode_other(arg: Any, kind: type, call: Call, signature: list[Any]) -> None:
    if kind is list or kind is tuple or isinstance(arg, (list, tuple)):  # torch.Size is a tuple
        nested: list[Any] = []
        _encode_sequence(arg, call, nested)
        signature.append(tuple(nested))
    elif kind is bool:
        signature.append((bool, arg))
    elif kind in _TORCH_VALUE_TAGS or kind is complex:
        signature.append(arg)
    elif kind is torch.device:
        signature.append(kind)
    elif isinstance(arg, StandIn):
        call.inputs.append(arg)
        signature.append(arg._meta)
        call.values.append(arg._id)
    elif isinstance(arg, torch.Tensor):
        _encode_host_tensor(arg, call, signature)
    else:
        plain = _plain_type(arg)
        signature.append(plain(arg))  # subclasses of the plain types travel as those


def _plain_type(arg: Any) -> type:
    """The plain type (bool, int, float, str) an argument is an instance of; TypeError if none."""
    for plain in (bool, int, float, str):
        if isinstance(arg, plain):
            return plain
    raise TypeError(f"proxy: an argument of type {type(arg).__qualname__} cannot be sent to the device")


def _encode_host_tensor(arg: torch.Tensor, call: Call, signature: list[Any]) -> None:
    """A host tensor reaching an operation on stand-ins.

    It is a scalar, or one that torch's C++ made with the stand-in's (host) options: mixing
    by the program is caught in the torch-function mode, as the device would catch it.
    """
    host = arg.detach()
    if host.device.type != "cpu":
        raise same_device_error("cuda:0", str(host.device))
    if host.numel() * host.element_size() > protocol.HOST_ARGUMENT_BYTES:
        raise LargeHostTensor
    signature.append(("cpu", tuple(host.shape), tuple(host.stride()), host.dtype))
    host, raw = protocol.tensor_to_raw(host)
    payload = [_NAMES.dtype_names[host.dtype], list(host.shape), list(host.stride()), -1]
    call.host_tensors.append((payload, raw))
    call.values.append(payload)


# -- the wire form of a plan -----------------------------------------------------------------------
def plan_arguments(
    args: Sequence[Any], kwargs: dict[str, Any] | None
) -> tuple[list[Any], dict[str, Any] | None]:
    """The wire form of a call's arguments for OP_PLAN: slots where `encode_call` took values."""
    wire_args = [_plan_value(arg, top=True) for arg in args]
    wire_kwargs = {name: _plan_value(value, top=True) for name, value in kwargs.items()} if kwargs else None
    return wire_args, wire_kwargs


def _plan_value(arg: Any, top: bool) -> Any:
    kind = type(arg)
    if kind is int or kind is str or arg is None or kind is bool:
        return arg
    if kind is float:
        return _NUMBER_SLOT if top else arg
    if isinstance(arg, StandIn):
        return _TENSOR_SLOT
    if kind is list or kind is tuple or isinstance(arg, (list, tuple)):
        return [_plan_value(item, top=False) for item in arg]
    tag = _TORCH_VALUE_TAGS.get(kind)
    if tag is not None:
        return tag(arg)
    if kind is torch.device:
        return protocol.DEVICE_MARKER
    if kind is complex:
        return {protocol.TAG_COMPLEX: [arg.real, arg.imag]}
    if isinstance(arg, torch.Tensor):
        return _HOST_SLOT
    return _plan_value(_plain_type(arg)(arg), top=False)  # a float subclass is a plain value


def wire_arguments(
    args: Sequence[Any], kwargs: dict[str, Any] | None
) -> tuple[list[Any], dict[str, Any] | None]:
    """Arguments without tensors (of a factory the server runs) in their wire form."""
    wire_args = [_wire_value(arg) for arg in args]
    wire_kwargs = {name: _wire_value(value) for name, value in kwargs.items()} if kwargs else None
    return wire_args, wire_kwargs


def _wire_value(arg: Any) -> Any:
    if type(arg) is torch.device:
        return protocol.DEVICE_MARKER
    if isinstance(arg, (list, tuple)):
        return [_wire_value(item) for item in arg]
    return protocol.encode_value(arg, [])
