"""Plans: calls of an operator whose arguments the server decoded once, run again with new values.

A job sends a call it will repeat (the same operator, the same plain arguments, other tensors
and numbers) once as a plan (OP_PLAN): the arguments with {"slot": kind} where each run gives
a value. A run (OP_RUN) then carries only the plan id and the slot values: the executor binds
them to a copy of the decoded arguments and calls the operator, with no decoding of tags and
no output template to build (the job knows the outputs from the first run). Everything in a
plan comes from the job and is checked like any operation: its operator was served, its tags
are decoded by the codec, its slot values are checked at each run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from singularity.proxy.bootstrap._singularity_proxy import protocol
from singularity.proxy.bootstrap._singularity_proxy.protocol import ProtocolError

if TYPE_CHECKING:
    from .operators import Served


class TensorHolder(Protocol):
    """What a run needs of the session it runs in (session.Session): its tensors by handle."""

    tensors: dict[int, torch.Tensor]

    def tensor(self, handle: Any) -> torch.Tensor:
        """The tensor held under `handle`; ProtocolError if none is."""
        ...


_SLOT_KINDS = frozenset((protocol.SLOT_TENSOR, protocol.SLOT_NUMBER, protocol.SLOT_HOST_TENSOR))
_ARGS, _KWARGS = 0, 1


class Plan:
    """One planned call: the operator, its decoded arguments and where the slot values go."""

    __slots__ = ("args", "call", "general", "kwargs", "leaves", "nested", "served", "slots", "wire")

    def __init__(self, served: Served, args: Any, kwargs: Any, device: torch.device) -> None:
        if type(args) is not list or (kwargs is not None and type(kwargs) is not dict):
            raise ProtocolError("a plan's arguments are a list and its keyword arguments an object")
        self.served = served
        self.call = served.operator._op
        self.general = served.grows_inputs or served.reshapes_input or served.rebinds_input
        """Whether runs take the executor's full path (storages counted again after)."""
        self.slots: list[tuple[int, tuple[Any, ...], str]] = []
        """(root: args or kwargs, keys to the value, slot kind), in the order of the values."""
        self.nested: list[tuple[int, tuple[Any, ...]]] = []
        """Lists inside the arguments that hold slots (copied for each run), outer ones first."""
        self.leaves = 0
        self.args: list[Any] = self._decode(args, _ARGS, (), device)
        self.kwargs: dict[str, Any] = (
            {name: self._decode(value, _KWARGS, (name,), device) for name, value in kwargs.items()}
            if kwargs
            else {}
        )
        self.wire = [args, kwargs]
        """The plan as the job sent it (kept in checkpoints)."""

    def _decode(self, tree: Any, root: int, keys: tuple[Any, ...], device: torch.device) -> Any:
        """A value of the plan as the operator takes it; slots recorded and left as None."""
        self.leaves += 1
        if self.leaves > protocol.PLAN_LEAVES:
            raise ProtocolError("the plan is too large")
        kind = type(tree)
        if kind is list:
            before = len(self.slots)
            decoded = [self._decode(item, root, (*keys, i), device) for i, item in enumerate(tree)]
            if keys and len(self.slots) > before:
                self.nested.append((root, keys))
            return decoded
        if kind is not dict:
            return tree
        slot = tree.get(protocol.TAG_SLOT)
        if slot is not None and len(tree) == 1:
            if slot not in _SLOT_KINDS or not keys:
                raise ProtocolError(f"malformed slot {slot!r}")
            self.slots.append((root, keys, slot))
            return None
        if tree == protocol.DEVICE_MARKER:
            return device
        if protocol.TAG_HANDLE in tree or protocol.TAG_HOST_TENSOR in tree:
            raise ProtocolError("a plan gives tensors through slots")
        return protocol.decode_tag(tree, ())

    def bind(
        self, session: TensorHolder, values: Any, buffers: Sequence[Any], device: torch.device
    ) -> tuple[list[Any], dict[str, Any], list[int]]:
        """Arguments for one run with these slot values, and the handles of its tensor inputs."""
        if type(values) is not list or len(values) != len(self.slots):
            raise ProtocolError(f"a run of this plan gives {len(self.slots)} values")
        args = self.args.copy()
        kwargs = self.kwargs.copy() if self.kwargs else self.kwargs
        roots = (args, kwargs)
        for root, keys in self.nested[::-1]:  # outer lists were recorded after their items
            parent = _container(roots[root], keys)
            parent[keys[-1]] = parent[keys[-1]].copy()
        handles: list[int] = []
        tensors = session.tensors
        for (root, keys, kind), value in zip(self.slots, values, strict=True):
            if kind == protocol.SLOT_TENSOR:
                found = tensors.get(value) if type(value) is int else None
                if found is None:
                    found = session.tensor(value)  # raises
                handles.append(value)
                value = found
            elif kind == protocol.SLOT_NUMBER:
                if type(value) is not float and type(value) is not int:
                    raise ProtocolError(f"not a number: {value!r}"[:100])
            else:
                value = _host_tensor(value, buffers, device)
            target = roots[root] if len(keys) == 1 else _container(roots[root], keys)
            target[keys[-1]] = value
        return args, kwargs, handles


def _container(root: Any, keys: tuple[Any, ...]) -> Any:
    """The list or dict holding the value at `keys` under `root`."""
    for key in keys[:-1]:
        root = root[key]
    return root


def _host_tensor(payload: Any, buffers: Sequence[Any], device: torch.device) -> torch.Tensor:
    """A host tensor slot value ([dtype, shape, stride, buffer]) as a tensor on the device."""
    if type(payload) is not list or len(payload) != 4:
        raise ProtocolError(f"malformed host tensor {str(payload)[:100]}")
    dtype, shape, stride, index = payload
    values = protocol.tensor_from_raw(dtype, shape, stride, protocol.buffer_at(buffers, index))
    return values.to(device, copy=True)
