# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""Random numbers for proxied devices, drawn in the job with its CPU generator and uploaded.

A program on a virtual device thus draws exactly the numbers a direct CPU run draws, and
the generator's state stays in the job's memory, where a checkpoint of the process keeps it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .tensor import HOST, ProxyTensor, SpecialHandler, download, fill
from .transfers import upload

aten = torch.ops.aten
_FILL_IN_PLACE = {
    aten.bernoulli_.float,
    aten.normal_.default,
    aten.uniform_.default,
    aten.random_.default,
    getattr(aten.random_, "from"),
    aten.random_.to,
    aten.exponential_.default,
    aten.geometric_.default,
    aten.log_normal_.default,
    aten.cauchy_.default,
}
_SHAPED_LIKE = {
    aten.rand_like.default,
    aten.randn_like.default,
    aten.randint_like.default,
    aten.randint_like.low_dtype,
}
_FROM_VALUES = {
    aten.bernoulli.default,
    aten.bernoulli.p,
    aten.bernoulli_.Tensor,
    aten.multinomial.default,
    aten.normal.Tensor_float,
    aten.normal.float_Tensor,
    aten.normal.Tensor_Tensor,
    aten.poisson.default,
    aten.randperm.default,
}


class DeviceDefaultGenerator(torch._C.Generator):
    """`torch.cuda.default_generators[i]` of a proxied device. The device draws with the job's CPU
    generator, so this one stands for it: its state is that generator's, seeding it does nothing
    (as `torch.cuda.manual_seed`, which seeds it on a GPU), and an operator given it draws with
    the CPU generator (the device mode puts that in its place: C++ would pass on a plain
    generator of this one's own state)."""

    _index = 0

    def __new__(cls, index: int) -> DeviceDefaultGenerator:
        generator = super().__new__(cls, device="cpu")  # type: ignore[call-arg]
        generator._index = index
        return generator  # type: ignore[no-any-return]

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self._index)

    def get_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(self, new_state: Any) -> DeviceDefaultGenerator:  # type: ignore[override]
        set_device_rng_state(new_state)
        return self

    def manual_seed(self, seed: Any) -> DeviceDefaultGenerator:  # type: ignore[override]
        return self

    def seed(self) -> int:
        return torch.initial_seed()

    def initial_seed(self) -> int:
        return torch.initial_seed()


def set_device_rng_state(new_state: Any) -> None:
    """Set the generator proxied devices draw with (the job's CPU generator) to a state that
    `get_rng_state` gave, so that saving and restoring it replays the same numbers as on a GPU;
    a state of another generator (a real GPU's, from a file) is ignored, as seeding is."""
    ours = type(new_state) is torch.Tensor and new_state.dtype == torch.uint8
    if ours and new_state.numel() == torch.get_rng_state().numel():
        torch.set_rng_state(new_state)


def _host_arguments(args: Sequence[Any], kwargs: dict[str, Any], shapes_only: bool) -> tuple[Any, Any]:
    """The arguments with stand-ins brought to the host (as empty tensors when only shapes matter)."""

    def to_host(arg: Any) -> Any:
        if isinstance(arg, ProxyTensor):
            if shapes_only:
                return torch.empty_strided(arg.shape, arg.stride(), dtype=arg.dtype)
            return download(arg)
        if isinstance(arg, (list, tuple)):
            return type(arg)(to_host(item) for item in arg)
        if isinstance(arg, torch.device):
            return HOST
        return arg

    return [to_host(a) for a in args], {k: to_host(v) for k, v in kwargs.items()}


def _fill_in_place(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`x.normal_()` and the like: draw on the host into a tensor shaped like x, then fill x."""
    target = args[0]
    drawn = torch.empty_strided(target.shape, target.stride(), dtype=target.dtype)
    host_args, host_kwargs = _host_arguments(args[1:], kwargs, shapes_only=False)
    func(drawn, *host_args, **host_kwargs)
    fill(target, drawn)
    return target


def _draw_and_upload(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`torch.rand_like(x)`, `torch.bernoulli(p)` and the like: draw on the host, upload."""
    index = next(a for a in args if isinstance(a, ProxyTensor))._channel.index
    host_args, host_kwargs = _host_arguments(args, kwargs, shapes_only=func in _SHAPED_LIKE)
    if func is aten.bernoulli_.Tensor:
        drawn = torch.empty_strided(args[0].shape, args[0].stride(), dtype=args[0].dtype)
        func(drawn, *host_args[1:], **host_kwargs)
        fill(args[0], drawn)
        return args[0]
    return upload(func(*host_args, **host_kwargs), index)


def _on_host(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Any other random operator (`rrelu_with_noise`, `_standard_gamma`, `binomial`): run on host copies.

    The inputs are downloaded, the operator draws with the job's generator, tensors it wrote
    are filled back into their stand-ins and new tensors are uploaded.
    """
    index = next(a for a in (*args, *kwargs.values()) if isinstance(a, ProxyTensor))._channel.index
    host_args, host_kwargs = _host_arguments(args, kwargs, shapes_only=False)
    output = func(*host_args, **host_kwargs)
    schema = func._schema
    written: dict[int, ProxyTensor] = {}
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        stand_in = args[position] if position < len(args) else kwargs.get(argument.name)
        host = host_args[position] if position < len(args) else host_kwargs.get(argument.name)
        if isinstance(stand_in, ProxyTensor):
            fill(stand_in, host)
            written[id(host)] = stand_in

    def place(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return written.get(id(value)) or upload(value, index)
        if isinstance(value, (list, tuple)):
            return type(value)(place(item) for item in value)
        return value

    return place(output)


def host_random_handler(func: Any) -> SpecialHandler | None:
    """The handler of a random operator not listed here (None for an operator that is not random)."""
    return _on_host if torch.Tag.nondeterministic_seeded in func.tags else None


RANDOM_OPS: dict[Any, SpecialHandler] = {func: _fill_in_place for func in _FILL_IN_PLACE}
RANDOM_OPS.update({func: _draw_and_upload for func in _SHAPED_LIKE | _FROM_VALUES})
"""Random operators, carried out by the client."""
