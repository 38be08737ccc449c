"""Which arguments an operator writes, from its schema, so that every write shows in version counters.

A pre-copy of device state (snapshot.py) trusts a tensor's version counter to change whenever its
bytes do. Most kernels bump it themselves through autograd's in-place bookkeeping; some (fused
optimizers, for one) do not, so the executor bumps it after each operation for every argument the
schema marks written (`Tensor(a!)`, `Tensor(a!)[]`). The same arguments are the ones a session must
own before the operation runs, where it shares their storage with other sessions (dedup.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}
"""Operator -> (position, name) of each argument its schema says it writes (Tensor(a!), Tensor(a!)[])."""


def written_arguments(operator: Any) -> tuple[tuple[int, str], ...]:
    """Where an operator's schema says it writes its arguments (cached per operator)."""
    found = _WRITTEN.get(operator)
    if found is None:
        schema = operator._schema.arguments
        found = tuple(
            (i, a.name) for i, a in enumerate(schema) if a.alias_info is not None and a.alias_info.is_write
        )
        _WRITTEN[operator] = found
    return found


def written_tensors(operator: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors among an operator's arguments that its schema says it writes."""
    for position, name in written_arguments(operator):
        value = args[position] if position < len(args) else kwargs.get(name)
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(tensor, torch.Tensor):
                yield tensor


def note_writes(operator: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Bump the version counter of every tensor an operator just wrote, as its schema says.

    Most kernels do it themselves; some (fused optimizers, for one) do not, and a pre-copy must
    see every write.
    """
    for tensor in written_tensors(operator, args, kwargs):
        if not tensor.is_inference():
            torch.autograd.graph.increment_version(tensor)
