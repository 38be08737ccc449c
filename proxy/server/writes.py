"""Which arguments an operator writes, from its schema, so that every write shows in version counters.

A pre-copy of device state (snapshot.py) trusts a tensor's version counter to change whenever its
bytes do. Most kernels bump it themselves through autograd's in-place bookkeeping; some (fused
optimizers, for one) do not, so the executor bumps it after each operation for every argument the
schema marks written (`Tensor(a!)`, `Tensor(a!)[]`), and for the running statistics of a BatchNorm
in training, which its schema does not mark. The same arguments are the ones a session must
own before the operation runs, where it shares their storage with other sessions (dedup.py): an
in-place pointwise operator, or one that overwrites its argument (`copy_`), on the whole of a
shared storage can instead run out of place (`out_of_place`), into a new storage that then becomes
the session's, which spares copying the shared bytes first.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import torch

_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}
"""Operator -> (position, name) of each argument its schema says it writes (Tensor(a!), Tensor(a!)[])."""
_OUT_OF_PLACE: dict[Any, Any] = {}
"""In-place operator -> its out-of-place form, or None."""
OVERWRITING: frozenset[Any] = frozenset(
    (
        torch.ops.aten.copy_.default,
        torch.ops.aten.fill_.Scalar,
        torch.ops.aten.fill_.Tensor,
        torch.ops.aten.zero_.default,
    )
)
"""Operators that write every element of their first argument without reading it."""
RUNNING_STATS_WRITERS: frozenset[str] = frozenset(
    ("aten::native_batch_norm", "aten::batch_norm", "aten::_batch_norm_impl_index", "aten::cudnn_batch_norm",
     "aten::miopen_batch_norm")
)  # fmt: skip
"""BatchNorm's operators whose schema hides a write: in training (argument 5) they update their
running mean and variance (arguments 3 and 4) in place."""
RUNNING_STATS_GATHERERS: frozenset[str] = frozenset(
    ("aten::batch_norm_gather_stats_with_counts", "aten::batch_norm_gather_stats")
)
"""SyncBatchNorm's operators whose schema hides a write: they always update their running mean
and variance (arguments 3 and 4) in place, where those are given."""
_RUNNING_STATS: dict[Any, str] = {}
"""Operator -> when it updates running statistics: "" (never), "training" (RUNNING_STATS_WRITERS)
or "always" (RUNNING_STATS_GATHERERS)."""


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


def out_of_place(operator: Any) -> Any:
    """A function that computes, as a new tensor, what an in-place operator writes into its first
    argument (its only written one), leaving that argument as it was; or None. For a pointwise
    operator, its out-of-place form (aten::mul_.Tensor -> aten::mul.Tensor: the same kernel); for
    one that overwrites its first argument without reading it (`copy_`, `fill_`, `zero_`), itself
    run on a new tensor of the same layout."""
    if operator in _OUT_OF_PLACE:
        return _OUT_OF_PLACE[operator]
    found = None
    schema = getattr(operator, "_schema", None)
    namespace, _, name = schema.name.partition("::") if schema is not None else ("", "", "")
    if operator in OVERWRITING:
        found = partial(_on_new_tensor, operator)
    elif (
        name.endswith("_")
        and torch.Tag.pointwise in operator.tags
        and written_arguments(operator) == ((0, "self"),)
    ):
        packet = getattr(getattr(torch.ops, namespace), name[:-1], None)
        candidate = getattr(packet, operator._overloadname, None) if packet is not None else None
        if (
            candidate is not None
            and torch.Tag.pointwise in candidate.tags
            and not written_arguments(candidate)
        ):
            found = candidate
    _OUT_OF_PLACE[operator] = found
    return found


def covers_its_storage(tensor: torch.Tensor) -> bool:
    """Whether a tensor's elements are every byte of its storage, each once."""
    return (
        tensor.storage_offset() == 0
        and tensor.is_contiguous()
        and tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes()
    )


def _on_new_tensor(operator: Any, target: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """Run an operator that overwrites its first argument on a new tensor laid out like `target`."""
    return operator(torch.empty_like(target), *args, **kwargs)


def written_tensors(operator: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors among an operator's arguments that it writes: those its schema marks, and the
    running statistics a BatchNorm in training (RUNNING_STATS_WRITERS) or SyncBatchNorm's
    gathering of statistics (RUNNING_STATS_GATHERERS) updates."""
    for position, name in written_arguments(operator):
        value = _argument(args, kwargs, position, name)
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(tensor, torch.Tensor):
                yield tensor
    updates = _running_stats_updates(operator)
    if updates == "always" or (updates == "training" and _argument(args, kwargs, 5, "training")):
        for position, name in ((3, "running_mean"), (4, "running_var")):
            stats = _argument(args, kwargs, position, name)
            if isinstance(stats, torch.Tensor):
                yield stats


def _running_stats_updates(operator: Any) -> str:
    """When an operator updates running statistics its schema does not mark written (see
    _RUNNING_STATS; cached per operator: a hot path)."""
    found = _RUNNING_STATS.get(operator)
    if found is None:
        name = operator._schema.name
        found = "training" if name in RUNNING_STATS_WRITERS else ""
        found = "always" if name in RUNNING_STATS_GATHERERS else found
        _RUNNING_STATS[operator] = found
    return found


def _argument(args: Sequence[Any], kwargs: dict[str, Any], position: int, name: str) -> Any:
    return args[position] if position < len(args) else kwargs.get(name)


def note_writes(operator: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Bump the version counter of every tensor an operator just wrote, as its schema says.

    Most kernels do it themselves; some (fused optimizers, for one) do not, and a pre-copy must
    see every write.
    """
    for tensor in written_tensors(operator, args, kwargs):
        if not tensor.is_inference():
            torch.autograd.graph.increment_version(tensor)
