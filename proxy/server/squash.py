"""Operation squashing: an operation that spliced replicas all run is run once per device.

Ranks of a data-parallel job spliced on one device run the same optimizer step on the same
parameters and state (kept once, dedup.py). Without squashing each rank writes them in turn,
so each first takes its own copy (copy-on-write) and the next collective folds the copies back:
the device briefly holds a copy of the model per rank. Here every storage on the device that an
operation read or wrote gets a value id (`DeviceMemory.values`): two storages with one value id
hold the same bytes. The key of an operation is its operator and its arguments, each tensor
replaced by its storage's value id and its layout. The first session of a job to run an
operation records what it produced; another session of the job that runs an operation under the
same key does not run it: its written storages move onto the producer's (`Session.repoint`,
shared and copy-on-write from then on) and its new outputs are views of the producer's outputs.

Value ids are numbered by derivation: a storage an operation wrote holds the value id of that
operation's key and output, whichever session computed it, so a chain of in-place operations
(Adam's mul_ then addcmul_ on one state) matches again after one link had to run twice.
A near miss (the key differs only in inputs whose storages hold other value ids, as the
gradients DDP copies out of each rank's bucket do) is checked by comparing those storages'
bytes (dedup.same_bytes); when they are equal the session's inputs move onto the producer's
and the operation is squashed.

Only operators that are deterministic functions of their inputs take part: not those that
draw random numbers, return views or non-tensor values, allocate uninitialised memory, or
resize, restride or rebind their arguments; nor sparse, inference or quantized tensors.
Value ids are dropped whenever anything else writes a storage (the executor's other writes,
collectives' outputs), so a recorded value is trusted only while its storage is untouched.
How long a recorded operation is kept, and what it keeps on the device meanwhile: memo.py.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .dedup import Dedup, same_bytes
from .device_memory import DeviceMemory
from .memo import Entry, Memo, new_storages
from .session import Session, rebindable
from .writes import OVERWRITING, covers_its_storage, written_tensors

UNUSED_LIMIT = 16
"""Entries of an operator dropped unused before it is no longer recorded (until sessions come or
go), unless one of its calls was ever squashed: the forward and backward passes of the ranks'
own data, whose keys never match, then cost one look-up per call."""
MISS = object()
"""What `Squash.reuse` answers when the call must run."""
_OVERWRITES = frozenset(id(op) for op in OVERWRITING)
"""writes.OVERWRITING by identity (an OpOverload hashes slowly): their result does not depend on
what their first (written) argument held before."""


@dataclass
class Leaf:
    """One tensor argument of a call: the tensor, its storage key and whether the operator writes it."""

    tensor: torch.Tensor
    key: int
    written: bool


@dataclass
class Call:
    """An operation about to run, as squashing sees it."""

    operator: Any
    leaves: list[Leaf]
    shape: tuple[Any, ...]
    """The arguments with tensors as their layouts, other values made hashable (the coarse key)."""
    key: tuple[Any, ...] = ()
    """The coarse key with each tensor's value id and which tensors share a storage (the exact key)."""
    inputs: tuple[tuple[int, int], ...] = ()
    """(storage key, value id) of each tensor argument before the call runs."""
    led: bool = False
    """Whether every storage the call uses was shared with another session when it ran: what it
    makes is what they will be squashed onto (executor.py `_note_lead`)."""


def eligible(operator: Any) -> bool:
    """Whether an operator's result is a function of its arguments' bytes and layouts alone."""
    found = _ELIGIBLE.get(id(operator))
    if found is None:
        found = _judge(operator)
        _ELIGIBLE[id(operator)] = found
        _KEPT.append(operator)  # its identity stays its own
    return found


_ELIGIBLE: dict[int, bool] = {}
"""id(operator) -> whether it is eligible (an OpOverload hashes slowly)."""
_KEPT: list[Any] = []


def _judge(operator: Any) -> bool:
    """`eligible`, worked out from the operator's schema and tags."""
    if not isinstance(operator, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in operator.tags or torch.Tag.inplace_view in operator.tags:
        return False
    name = operator._schema.name.split("::")[-1]
    if "empty" in name or name in ("resize_", "resize_as_", "set_", "_local_scalar_dense", "item"):
        return False
    schema = operator._schema
    for argument in schema.arguments:
        kind = str(argument.type)
        if "Generator" in kind or (argument.name == "size" and kind == "List[int]"):
            return False
        written = argument.alias_info is not None and argument.alias_info.is_write
        if written and argument.is_out:
            return False  # out= arguments (whatever their name) may be resized
    for returned in schema.returns:
        if str(returned.type) not in ("Tensor", "Tensor[]", "Tensor?"):
            return False
        if returned.alias_info is not None and not returned.alias_info.is_write:
            return False  # a view of an input: nothing to save
    return bool(schema.returns)


def _hashable(value: Any, leaves: list[torch.Tensor]) -> Any:
    """A value of the arguments as part of a key (tensors as their layouts, appended to `leaves`)."""
    kind = type(value)
    if kind is torch.Tensor or isinstance(value, torch.Tensor):
        if not rebindable(value):
            raise LookupError
        leaves.append(value)
        return (torch.Tensor, value.storage_offset(), tuple(value.shape), value.stride(), value.dtype)
    if kind is float:
        return (float, struct.pack("<d", value))  # -0.0 and 0.0 differ, NaN equals itself
    if kind is int or kind is bool or kind is str or value is None:
        return (kind, value)
    if kind is list or kind is tuple:
        return (kind, tuple(_hashable(item, leaves) for item in value))
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return (kind, value)
    raise LookupError


class Squash:
    """The memo of a device: operations of spliced jobs' sessions, by key, for the others to reuse."""

    def __init__(
        self, memory: DeviceMemory[Session], dedup: Dedup, job_sessions: Callable[[str], list[Session]]
    ) -> None:
        self.memory = memory
        self.dedup = dedup
        self.job_sessions = job_sessions
        self.memo = Memo(memory, job_sessions)
        self.spliced: dict[str, bool] = {}
        """Job -> whether more than one of its sessions is here (cleared when sessions come or go)."""
        self.lock = threading.Lock()
        """Held while the memo is looked up or changed."""
        self.useful: set[int] = set()
        """id(operator) of each operator whose call was squashed once."""
        self.squashed = 0
        """Operations not run because another session of the job had run them."""
        self.saved_bytes = 0
        """Bytes those operations would have written or allocated."""
        self.near_compares = 0
        self.near_compared_bytes = 0
        self.near_hits = 0

    # -- value ids ---------------------------------------------------------------------------------
    def value(self, key: int) -> int:
        """The value id of a storage (a fresh one if it had none)."""
        values = self.memory.values
        found = values.get(key)
        if found is None:
            found = values[key] = self.memo.fresh()
        return found

    def active(self, session: Session) -> bool:
        """Whether the session's job has other sessions on this device (only then is anything kept)."""
        found = self.spliced.get(session.job_id)
        if found is None:
            found = self.spliced[session.job_id] = len(self.job_sessions(session.job_id)) > 1
            if not found:
                self.drop_job(session.job_id)
        return found

    def sessions_changed(self) -> None:
        """A session came or went: whether jobs are spliced is worked out again, and every
        operator is recorded again."""
        self.spliced = {}
        self.memo.unused.clear()

    # -- before an operation --------------------------------------------------------------------------
    def prepare(self, operator: Any, args: list[Any], kwargs: dict[str, Any]) -> Call | None:
        """The call as squashing sees it, or None if its operator or arguments do not take part."""
        if not eligible(operator):
            return None
        if self.memo.unused.get(id(operator), 0) >= UNUSED_LIMIT and id(operator) not in self.useful:
            return None
        tensors: list[torch.Tensor] = []
        try:
            shape = (id(operator), _hashable(args, tensors), _hashable(sorted(kwargs.items()), tensors))
        except LookupError:
            return None
        written = {id(t) for t in written_tensors(operator, args, kwargs)}
        leaves = [Leaf(t, t.untyped_storage()._cdata, id(t) in written) for t in tensors]
        holders = self.memory.holders
        if not all(leaf.key in holders for leaf in leaves):
            return None  # a tensor sent with the call (held by no session): no value id to trust
        call = Call(operator, leaves, shape)
        call.key = self._exact(call)
        return call

    def _exact(self, call: Call) -> tuple[Any, ...]:
        """The exact key of a call (its inputs' value ids noted in `call.inputs`)."""
        call.inputs = tuple((leaf.key, self.value(leaf.key)) for leaf in call.leaves)
        first: dict[int, int] = {}
        sharing = tuple(first.setdefault(leaf.key, i) for i, leaf in enumerate(call.leaves))
        values = [value for _key, value in call.inputs]
        if id(call.operator) in _OVERWRITES and self._covers_storage(call.leaves[0]):
            values[0] = 0  # every byte of its storage is written: what it held does not matter
        return (call.shape, tuple(values), sharing)

    def _covers_storage(self, leaf: Leaf) -> bool:
        """Whether a written tensor's elements are every byte of its storage, each once (as its
        session counts the storage: one moved to host memory keeps its size there)."""
        if not leaf.written:
            return False
        holders = self.memory.holders.get(leaf.key)
        if not holders or leaf.key not in holders[0].swapped:
            return covers_its_storage(leaf.tensor)
        return holders[0].covers_counted(leaf.tensor)

    def reuse(self, session: Session, call: Call) -> Any:
        """The output of the call, made from another session's run of it, if one can be reused
        (the session's written storages moved onto the producer's); else MISS and the call runs."""
        with self.lock:
            entry = self.memo.awaited(call.key, session)
            if entry is None:
                entry = self._near_miss(session, call)
            if entry is None or entry.producer is session:
                return MISS
            entry.consumed.add(session)
            output = self._squash(session, call, entry)
            if output is not MISS:
                taken = {key for key, _value in new_storages(entry.output)}
                self.memo.retire(call.key, entry, taken)
            return output

    def _storage(self, key: int, value: int, bring_back: bool = True) -> torch.UntypedStorage | None:
        """The storage `key` if it still holds value `value` and can be shared (one its session
        moved to host memory is brought back if `bring_back`, else it is not given)."""
        if self.memory.values.get(key) != value or key in self.dedup.pinned:
            return None
        holders = self.memory.holders.get(key)
        if not holders:
            kept = self.memory.kept.get(key)
            return None if kept is None else kept[0]
        holder = holders[0]
        tensors = [holder.tensors[h] for h in holder.handles_on.get(key, ())]
        if not tensors or not all(rebindable(t) for t in tensors):
            return None
        if key in holder.swapped:  # moved to host memory while its session waits (collectives.py)
            if not bring_back:
                return None
            try:
                holder.swap_in(key)
            except torch.OutOfMemoryError:
                return None
        return tensors[0].untyped_storage()

    def _movable(self, session: Session, key: int, onto: int) -> bool:
        """Whether the session's storage `key` may move onto storage `onto`."""
        if key == onto:
            return True
        if onto in session.storages or key in self.dedup.pinned or key not in session.storages:
            return False
        return all(rebindable(session.tensors[h]) for h in session.handles_on[key])

    def _squash(self, session: Session, call: Call, entry: Entry) -> Any:
        """Move the call's written storages onto the producer's; the output as the producer's views."""
        moves: dict[int, torch.UntypedStorage] = {}
        for index, (key, value) in entry.written.items():
            storage = self._storage(key, value)
            mine = call.leaves[index].key
            if storage is None or not self._movable(session, mine, key):
                return MISS
            if mine != key:
                moves[mine] = storage
        news: dict[int, torch.UntypedStorage] = {}
        for key, value in new_storages(entry.output):
            storage = self._storage(key, value)
            if storage is None or key in session.storages:
                return MISS
            news[key] = storage
        saved = 0
        for mine, storage in moves.items():
            session.repoint(mine, storage)
            saved += storage.nbytes()
        saved += sum(s.nbytes() for s in news.values())
        self.squashed += 1
        entry.used = True
        self.useful.add(id(call.operator))
        self.saved_bytes += saved
        return _rebuild(entry.output, call.leaves, news)

    def _near_miss(self, session: Session, call: Call) -> Entry | None:
        """An entry under the call's coarse key whose differing inputs hold the same bytes as the
        call's (those inputs then moved onto the entry's storages), if there is one."""
        for exact, entry in self.memo.near_entries(call.shape):
            if entry.producer is session or session in entry.consumed:
                continue
            pairs: dict[int, tuple[int, torch.UntypedStorage, torch.UntypedStorage]] = {}
            for leaf, (key, value), mine in zip(call.leaves, entry.inputs, call.inputs, strict=True):
                if mine[1] == value:
                    continue
                other = None if leaf.written else self._storage(key, value, bring_back=False)
                if other is None or not self._movable(session, leaf.key, key):
                    pairs = {}
                    break
                if pairs.get(leaf.key, (key,))[0] != key:
                    pairs = {}
                    break
                pairs[leaf.key] = (key, leaf.tensor.untyped_storage(), other)
            if not pairs:
                continue
            entry.consumed.add(session)
            if not all(self._same(mine, other) for _key, mine, other in pairs.values()):
                continue
            for key, (_key, _mine, other) in pairs.items():
                session.repoint(key, other)
            for leaf in call.leaves:
                leaf.key = leaf.tensor.untyped_storage()._cdata
            call.key = self._exact(call)
            if call.key == exact:
                self.near_hits += 1
                return entry
        return None

    def _same(self, mine: torch.UntypedStorage, other: torch.UntypedStorage) -> bool:
        self.near_compares += 1
        self.near_compared_bytes += mine.nbytes()
        return same_bytes(mine, other)

    # -- after an operation ---------------------------------------------------------------------------
    def record(self, session: Session, call: Call, output: Any) -> None:
        """Remember what a call that ran produced (value ids numbered by its key), once its new
        tensors are held."""
        with self.lock:
            leaves = call.leaves
            values = self.memory.values
            inputs = call.inputs
            input_keys = {leaf.tensor.untyped_storage()._cdata for leaf in leaves}
            written: dict[int, tuple[int, int]] = {}
            slot = 0
            for index, leaf in enumerate(leaves):
                key = leaf.tensor.untyped_storage()._cdata
                if leaf.written and all(k != key for k, _v in written.values()):
                    written[index] = (key, self.memo.derive(call.key, slot))
                    slot += 1
                    values[key] = written[index][1]
            news: dict[int, int] = {}

            def shape(value: Any) -> Any:
                nonlocal slot
                if value is None:
                    return ("none",)
                if isinstance(value, (list, tuple)):
                    return ("list" if type(value) is list else "tuple", [shape(v) for v in value])
                if not isinstance(value, torch.Tensor) or not rebindable(value):
                    raise LookupError
                for index, leaf in enumerate(leaves):
                    if value is leaf.tensor:
                        return ("alias", index)
                key = value.untyped_storage()._cdata
                if key in input_keys or key not in self.memory.holders:
                    raise LookupError  # shares an input's storage without being that tensor
                if key not in news:
                    news[key] = self.memo.derive(call.key, slot)
                    slot += 1
                    values[key] = news[key]
                layout = (tuple(value.shape), value.stride(), value.storage_offset(), value.dtype)
                return ("new", key, news[key], *layout)

            try:
                made = shape(output)
            except LookupError:
                for key in news:
                    values.pop(key, None)
                return
            round_ = self.dedup.ranks[session].rounds if session in self.dedup.ranks else 0
            entry = Entry(session.job_id, session, round_, inputs, written, made)
            likely_reused = call.led or id(call.operator) in self.useful
            self.memo.add(call.key, call.shape, entry, keeps=likely_reused)

    def wrote(self, tensors: Iterator[torch.Tensor]) -> None:
        """Tensors were written by something squashing does not follow: their value ids are void."""
        values = self.memory.values
        if values:
            for tensor in tensors:
                values.pop(tensor.untyped_storage()._cdata, None)

    # -- lifetime -------------------------------------------------------------------------------------
    def at_collective(self, job_id: str) -> None:
        """Drop the job's entries that every session of it has passed a collective since."""
        with self.lock:
            states = [self.dedup.ranks.get(s) for s in self.job_sessions(job_id)]
            passed = min((state.rounds if state else 0 for state in states), default=0)
            self.memo.drop_before(job_id, passed)

    def drop_job(self, job_id: str) -> None:
        """Forget the job's entries (and let go what they kept): it has one session here or none."""
        with self.lock:
            self.memo.drop_job(job_id)

    def clear(self) -> None:
        """Forget everything (device state replaced wholesale: a load)."""
        with self.lock:
            self.memo.clear()
            self.memory.values.clear()

    def figures(self) -> dict[str, Any]:
        """Squashed operations, near-miss comparisons and the bytes squashing saved."""
        return {
            "squashed": self.squashed,
            "squashed_bytes": self.saved_bytes,
            "near_compares": self.near_compares,
            "near_compared_bytes": self.near_compared_bytes,
            "near_hits": self.near_hits,
            "memo_entries": len(self.memo),
        }


def _rebuild(output: Any, leaves: list[Leaf], storages: dict[int, torch.UntypedStorage]) -> Any:
    """The output a squashed call returns: its inputs where it returned them, else views of the
    producer's new storages with the recorded layouts."""
    kind = output[0]
    if kind == "none":
        return None
    if kind == "alias":
        return leaves[output[1]].tensor
    if kind == "list":
        return [_rebuild(item, leaves, storages) for item in output[1]]
    if kind == "tuple":
        return tuple(_rebuild(item, leaves, storages) for item in output[1])
    _, key, _value, size, stride, offset, dtype = output
    storage = storages[key]
    made = torch.empty(0, dtype=dtype, device=storage.device)
    with torch.no_grad():
        made.set_(storage, offset, size, stride)
    return made
