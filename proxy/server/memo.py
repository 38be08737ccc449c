"""The memo of squashing (squash.py): recorded operations by key, how long each is kept, and the
storages kept for the sessions that have not used them yet.

An entry is kept until every other session of its job used it, or until every session of the
job passed a collective since it was made (a call the others skipped will not come again), or
until its job has one session left here; at most `MAX_ENTRIES` are kept, the oldest going first.
A session that ran the same call twice in a row (Adam making both its states with `zeros_like`)
leaves the older entry in `earlier`, so each later session takes them in the order they were made.
Where an entry keeps what its producer made (`Entry.keeps`), the storages it names stay on the
device when the producer lets them go (`DeviceMemory.kept`), until no kept entry names them.

Not thread-safe: `Squash` calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .device_memory import DeviceMemory
from .session import Session

MAX_ENTRIES = 8192
"""Recorded operations kept per device at most (the oldest go first)."""
MAX_NEAR = 4
"""Recorded operations under one coarse key compared with a near miss."""


@dataclass
class Entry:
    """What the producer of an operation made: storages by key with their value ids, and the output."""

    job: str
    producer: Session
    round: int
    inputs: tuple[tuple[int, int], ...]
    """(storage key, value id) of each tensor argument before the operation ran."""
    written: dict[int, tuple[int, int]]
    """Leaf index of each written storage's first tensor -> (storage key, value id) after."""
    output: Any
    """The output's structure: ("alias", leaf), ("new", storage key, value id, size, stride,
    offset, dtype), ("none",), ("list" | "tuple", items)."""
    consumed: set[Session] = field(default_factory=set)
    used: bool = False
    """Whether another session was squashed onto it."""
    keeps: bool = False
    """Whether what it wrote and made is kept when its producer lets it go (its operator's calls
    were squashed before: the other sessions are likely to reuse this one too)."""


Key = tuple[Any, ...]
"""An exact key: (coarse key, value ids, storage sharing); the coarse key starts with id(operator)."""


class Memo:
    """The recorded operations of a device's spliced jobs, and their lifetimes."""

    def __init__(self, memory: DeviceMemory[Session], job_sessions: Callable[[str], list[Session]]) -> None:
        self.memory = memory
        self.job_sessions = job_sessions
        self.entries: OrderedDict[Key, Entry] = OrderedDict()
        self.earlier: dict[Key, list[Entry]] = {}
        """Exact key -> older entries under it that other sessions have still to use, oldest first."""
        self.near: dict[Key, list[Key]] = {}
        """Coarse key -> exact keys of the entries recorded under it (newest last)."""
        self.derived: dict[tuple[Key, int], int] = {}
        """(exact key, output slot) -> the value id of what it produces, while its entry is kept."""
        self.referenced: dict[int, int] = {}
        """Storage identity -> entries that keep it (`Entry.keeps`) and name it as written or made."""
        memory.keeps = self.referenced.__contains__
        self.unused: dict[int, int] = {}
        """id(operator) -> its entries dropped unused since sessions last came or went."""
        self.next_value = 1

    def __len__(self) -> int:
        return len(self.entries)

    # -- value ids ---------------------------------------------------------------------------------
    def fresh(self) -> int:
        """A value id no storage held before."""
        value = self.next_value
        self.next_value += 1
        return value

    def derive(self, key: Key, slot: int) -> int:
        """The value id of output `slot` of the operation under `key` (the same for every session)."""
        found = self.derived.get((key, slot))
        if found is None:
            if len(self.derived) > 4 * MAX_ENTRIES:
                self.derived.clear()  # ids of operations recorded without an entry (a safety net)
            found = self.derived[(key, slot)] = self.fresh()
        return found

    # -- looking up ----------------------------------------------------------------------------------
    def awaited(self, key: Key, session: Session) -> Entry | None:
        """The entry under `key` for the session: the oldest it has not used yet, else the newest."""
        for entry in self.earlier.get(key, ()):
            if entry.producer is not session and session not in entry.consumed:
                return entry
        return self.entries.get(key)

    def near_entries(self, shape: Key) -> list[tuple[Key, Entry]]:
        """The newest entries recorded under a coarse key (newest first), at most `MAX_NEAR`."""
        found = []
        for exact in reversed(self.near.get(shape, [])[-MAX_NEAR:]):
            entry = self.entries.get(exact)
            if entry is not None:
                found.append((exact, entry))
        return found

    # -- keeping -------------------------------------------------------------------------------------
    def add(self, key: Key, shape: Key, entry: Entry, keeps: bool) -> None:
        """Keep a new entry under its exact key (and coarse key `shape`); with `keeps`, what it
        names stays on the device for the other sessions even once its producer lets it go."""
        replaced = self.entries.pop(key, None)
        if replaced is None:
            self.near.setdefault(shape, []).append(key)
        self.entries[key] = entry
        if keeps:
            entry.keeps = True
            for storage in storages_named(entry):
                self.referenced[storage] = self.referenced.get(storage, 0) + 1
        if replaced is not None:
            if replaced.producer is entry.producer and not self._used_by_all(replaced):
                self.earlier.setdefault(key, []).append(replaced)
            else:
                self._unreference(replaced)
        while len(self.entries) > MAX_ENTRIES:
            oldest, first = next(iter(self.entries.items()))
            self._drop(oldest, first)

    def retire(self, key: Key, entry: Entry, taken: set[int]) -> None:
        """Drop an entry once every other session of its job has used it (the storages in `taken`,
        which the last one is about to hold, stay kept until it does: their value ids go on)."""
        if not self._used_by_all(entry):
            return
        older = self.earlier.get(key)
        if older is not None and entry in older:
            self._forget_earlier(key, entry, taken)
        else:
            self._drop(key, entry, taken)

    def drop_before(self, job_id: str, round_: int) -> None:
        """Drop the job's entries made before collective round `round_` (every session of the job
        passed it)."""
        self._drop_where(lambda entry: entry.job == job_id and entry.round < round_)

    def drop_job(self, job_id: str) -> None:
        """Drop the job's entries (and let go what they kept)."""
        self._drop_where(lambda entry: entry.job == job_id)

    def clear(self) -> None:
        """Forget everything, and let go every kept storage."""
        self.entries.clear()
        self.earlier.clear()
        self.near.clear()
        self.derived.clear()
        self.referenced.clear()
        for key in list(self.memory.kept):
            self.memory.release(key)

    def _drop_where(self, doomed: Callable[[Entry], bool]) -> None:
        for key, entry in list(self.entries.items()):
            if doomed(entry):
                self._drop(key, entry)
        for key, older in list(self.earlier.items()):
            for entry in list(older):
                if doomed(entry):
                    self._forget_earlier(key, entry)

    def _used_by_all(self, entry: Entry) -> bool:
        """Whether every other session of the entry's job has used it."""
        return all(s in entry.consumed for s in self.job_sessions(entry.job) if s is not entry.producer)

    def _forget_earlier(self, key: Key, entry: Entry, taken: set[int] | None = None) -> None:
        """Drop one of the older entries under `key`."""
        older = self.earlier[key]
        older.remove(entry)
        if not older:
            del self.earlier[key]
        self._unreference(entry, taken)

    def _drop(self, key: Key, entry: Entry, taken: set[int] | None = None) -> None:
        if not entry.used:
            operator = key[0][0]
            self.unused[operator] = self.unused.get(operator, 0) + 1
        self.entries.pop(key, None)
        keys = self.near.get(key[0])
        if keys is not None:
            if key in keys:
                keys.remove(key)
            if not keys:
                del self.near[key[0]]
        for slot in range(len(entry.written) + len(new_storages(entry.output))):
            self.derived.pop((key, slot), None)
        self._unreference(entry, taken)

    def _unreference(self, entry: Entry, taken: set[int] | None = None) -> None:
        """An entry is gone: the storages no entry names any more are let go if they were kept
        (but for those in `taken`, about to be held)."""
        if not entry.keeps:
            return
        for storage in storages_named(entry):
            left = self.referenced.get(storage, 0) - 1
            if left > 0:
                self.referenced[storage] = left
            else:
                self.referenced.pop(storage, None)
                if taken is None or storage not in taken:
                    self.memory.release(storage)


def storages_named(entry: Entry) -> set[int]:
    """The storages an entry's producer wrote or made."""
    written = {key for key, _value in entry.written.values()}
    return written | {key for key, _value in new_storages(entry.output)}


def new_storages(output: Any) -> list[tuple[int, int]]:
    """(storage key, value id) of each new storage in a recorded output, once each."""
    found: dict[int, int] = {}

    def walk(item: Any) -> None:
        if item[0] == "new":
            found.setdefault(item[1], item[2])
        elif item[0] in ("list", "tuple"):
            for inner in item[1]:
                walk(inner)

    walk(output)
    return list(found.items())
