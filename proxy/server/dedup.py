"""Storages whose bytes are the same across the ranks of a job on this device, kept once.

When several ranks of a job share a device (replica splicing), data-parallel replicas hold the
same parameters and optimizer state after every step. Each time a rank reaches a collective, its
storages that changed since it last came, or whose counterparts in the other ranks did, of tensors
it already held then (parameters, optimizer state, buckets; not the step's activations), are
compared with the other ranks' on this device: first the storage under the same handle (replicas
allocate in the same order), then a few others of the same size. Bytes are compared in full (a
sample first, to reject quickly); on a match the rank's tensors move onto the other rank's storage
(`Session.repoint`) and its own copy is freed. Sharing is copy-on-write: before an operation
writes a shared storage (the arguments its schema marks written, writes.py), or a collective
writes its outputs, the writing session gets its own copy back.

The same comparison tells whether the ranks are replicas at all: at each collective that every rank
here waits at (none of them has stepped further than another), the share of each rank's long-lived storages
(held across its last two collectives) that another rank holds too is the evidence.
Replicas share their parameters and optimizer state; ranks with different parameters share
almost nothing. `summary` reports it, with the bytes, for the daemon's splicing decisions.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .device_memory import DeviceMemory
from .session import Session, rebindable
from .writes import covers_its_storage

MIN_SHARED_BYTES = 4096
"""Storages smaller than this are not compared (their bytes would not pay for the bookkeeping)."""
REPLICA_ROUNDS = 3
"""Rounds of collectives every rank here must reach before the ranks are judged replicas or not, and
rounds in a row their parameters must differ in before they are judged not replicas (ranks that
seed their own weights hold rank 0's only once DDP's broadcast has landed)."""
PARTIAL_ROUNDS = 3 * REPLICA_ROUNDS
"""Collectives in a row that only some of a job's ranks here take part in (a mesh's sub-groups:
tensor and data parallel) after which the ranks are judged at those collectives, among their
members, since no collective of all of them comes to judge them at."""
REPLICA_SHARE = 1 / 3
"""Replicas share at least this part of each rank's long-lived bytes (parameters, optimizer state;
a DDP bucket of unreduced gradients differs per rank, so about half with plain SGD)."""
MAX_CANDIDATES = 4
"""Storages of the same size compared with one storage, besides the one under its handle."""
_SAMPLE = 64
"""Bytes at each end of two storages compared before the whole."""


@dataclass
class RankDedup:
    """What the dedup knows of one session: what it checked, and its rounds of collectives."""

    checked: dict[int, Any] = field(default_factory=dict)
    """Storage key -> its stamp and its counterparts' when last compared without a match (all
    unchanged: not compared again)."""
    rounds: int = 0
    """Collectives this session reached (each one a comparison)."""
    handles_before: set[int] = field(default_factory=set)
    """The session's handles at its previous collective."""
    long_lived: set[int] = field(default_factory=set)
    """Handles held at both of its last two collectives."""


def _stamp(session: Session, key: int) -> tuple[Any, ...]:
    """What stays equal while a storage's bytes cannot have changed (marks and version counters)."""
    tensors = session.tensors
    versions = sorted((h, tensors[h]._version) for h in session.handles_on[key])
    return (session.storage_marks.get(key), *versions)


def _counterparts(session: Session, key: int, peers: list[Session]) -> tuple[Any, ...]:
    """The storages the peers hold under the storage's first handle, each with its stamp: a storage
    that matched none of them is compared again once one of them changes (a peer that stepped later
    may have come to hold the same bytes and matched another peer instead)."""
    handle = min(session.handles_on[key])
    found = []
    for peer in peers:
        tensor = peer.tensors.get(handle)
        if tensor is not None:  # a view's version counter is its base's: a write through any view counts
            keys = peer.storage_of.get(handle, ())
            found.append((keys, [peer.storage_marks.get(k) for k in keys], tensor._version))
    return tuple(found)


def _as_words(storage: torch.UntypedStorage) -> torch.Tensor:
    """A storage's bytes as a flat tensor of the widest integers that divide it (no copy; comparing
    int64 words is about 8x faster than bytes, and integers compare bit for bit)."""
    nbytes = storage.nbytes()
    dtype = next(d for d in (torch.int64, torch.int32, torch.int16, torch.uint8) if nbytes % d.itemsize == 0)
    raw = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    return raw.view(dtype)


def same_bytes(first: torch.UntypedStorage, second: torch.UntypedStorage) -> bool:
    """Whether two storages hold the same bytes, bit for bit (both ends first, then the whole)."""
    if first.nbytes() != second.nbytes() or first.device != second.device:
        return False
    a, b = _as_words(first), _as_words(second)
    sample = _SAMPLE // a.element_size()
    if a.numel() > 4 * sample and not (
        torch.equal(a[:sample], b[:sample]) and torch.equal(a[-sample:], b[-sample:])
    ):
        return False
    return torch.equal(a, b)


def _rebindable_storage(session: Session, key: int) -> torch.UntypedStorage | None:
    """The storage `key` of a session, if every tensor using it can move to another storage."""
    tensors = [session.tensors[h] for h in session.handles_on.get(key, ())]
    if not tensors or not all(rebindable(t) for t in tensors):
        return None
    return tensors[0].untyped_storage()


class Dedup:
    """Keeps identical storages of a job's sessions on this device once, and judges replicas."""

    def __init__(
        self,
        memory: DeviceMemory[Session],
        device_lock: threading.RLock,
        job_sessions: Callable[[str], list[Session]],
    ) -> None:
        self.memory = memory
        self.device_lock = device_lock
        """The executor's lock: nothing runs on the device while storages are compared and moved."""
        self.job_sessions = job_sessions
        self.ranks: weakref.WeakKeyDictionary[Session, RankDedup] = weakref.WeakKeyDictionary()
        self.pinned: set[int] = set()
        """Storages a collective is about to write: never shared until it is done."""
        self.verdicts: dict[str, tuple[str, str]] = {}
        """Job -> (replicas: "yes" or "no", why) at its last complete round."""
        self.apart_rounds: dict[str, int] = {}
        """Job -> complete rounds in a row in which its ranks here held different parameters."""
        self.partial_rounds: dict[str, int] = {}
        """Job -> collectives in a row of only some of its ranks here (`PARTIAL_ROUNDS`)."""
        self.compared: set[str] = set()
        """Jobs whose sessions here have been compared since they came (a collective, a quiesce, a
        load): until then their sharing figures are not measured yet, not zero."""
        self.compare_seconds = 0.0
        """Time spent comparing and moving storages since the server started."""
        self.compared_bytes = 0
        self.comparisons = 0

    def _state(self, session: Session) -> RankDedup:
        found = self.ranks.get(session)
        if found is None:
            found = self.ranks[session] = RankDedup()
        return found

    # -- at a collective ---------------------------------------------------------------------------
    def at_collective(self, session: Session, written: Iterable[torch.Tensor] = ()) -> None:
        """A session reached a collective: share what it holds like another rank here, count a round.
        The storages of the tensors the collective may write are left out (their bytes are about
        to change; `share_written` compares them after)."""
        peers = [s for s in self.job_sessions(session.job_id) if s is not session]
        if not peers:
            return
        with self.device_lock:
            state = self._state(session)
            skip = {tensor.untyped_storage()._cdata for tensor in written}
            self._share(session, peers, state.handles_before, skip)
            self.compared.add(session.job_id)
            state.rounds += 1
            handles = set(session.tensors)
            state.long_lived = state.handles_before & handles
            state.handles_before = handles

    def at_round(self, sessions: list[Session]) -> None:
        """These sessions all wait at one collective: if they are every session of their job here,
        judge whether they are replicas (only there has every rank here stepped as far as the
        others). A job whose collectives here are all of sub-groups (a 2-D mesh) is judged at them,
        among their members, once `PARTIAL_ROUNDS` of them came in a row."""
        if len(sessions) < 2:
            return
        job_id = sessions[0].job_id
        everyone = self.job_sessions(job_id)
        with self.device_lock:
            if {s.rank for s in sessions} == {s.rank for s in everyone}:
                self.partial_rounds[job_id] = 0
                self._judge(job_id, everyone)
                return
            partial = self.partial_rounds[job_id] = self.partial_rounds.get(job_id, 0) + 1
            if partial >= PARTIAL_ROUNDS:
                self._judge(job_id, sessions)

    def share_job(self, job_id: str) -> None:
        """Compare every session of the job with the others now (the device lock must be free)."""
        with self.device_lock:
            self.share_job_locked(job_id)

    def share_job_locked(self, job_id: str) -> None:
        """`share_job` for a caller that holds the device lock."""
        sessions = self.job_sessions(job_id)
        if len(sessions) < 2:
            return
        for session in sessions:
            self._share(session, [s for s in sessions if s is not session])
        self.compared.add(job_id)

    def _share(
        self,
        session: Session,
        peers: list[Session],
        lasting: set[int] | None = None,
        skip: set[int] | None = None,
    ) -> None:
        """Move the session's changed storages onto identical storages of its peers (with `lasting`,
        only those of tensors under these handles: what outlived the previous collective, not the
        step's activations), but for those in `skip`."""
        began = time.perf_counter()
        state = self._state(session)
        checked: dict[int, Any] = {}
        by_size: dict[int, list[tuple[Session, int]]] | None = None
        for key, (nbytes, _count) in list(session.storages.items()):
            if nbytes < MIN_SHARED_BYTES or key in self.pinned or self.memory.is_shared(key):
                continue
            if key in session.swapped:  # its bytes are in host memory while the session waits
                continue
            if skip and key in skip:
                continue
            if lasting is not None and lasting.isdisjoint(session.handles_on[key]):
                continue
            stamp = (_stamp(session, key), _counterparts(session, key, peers))
            if state.checked.get(key) == stamp:
                checked[key] = stamp
                continue
            storage = _rebindable_storage(session, key)
            if storage is None:
                checked[key] = stamp
                continue
            if by_size is None:
                by_size = self._sizes(peers)
            match = self._match(session, key, storage, peers, by_size.get(nbytes, []))
            if match is None:
                checked[key] = stamp
            else:
                session.repoint(key, match)
        state.checked = checked
        self.compare_seconds += time.perf_counter() - began

    def _sizes(self, peers: Iterable[Session]) -> dict[int, list[tuple[Session, int]]]:
        """The peers' storages worth comparing, by size (shared ones first)."""
        found: dict[int, list[tuple[Session, int]]] = {}
        for peer in peers:
            for key, (nbytes, _count) in peer.storages.items():
                if nbytes >= MIN_SHARED_BYTES:
                    found.setdefault(nbytes, []).append((peer, key))
        for candidates in found.values():
            candidates.sort(key=lambda c: not self.memory.is_shared(c[1]))
        return found

    def _match(
        self,
        session: Session,
        key: int,
        storage: torch.UntypedStorage,
        peers: list[Session],
        same_size: list[tuple[Session, int]],
    ) -> torch.UntypedStorage | None:
        """A peer's storage with the same bytes that the session may move onto, if there is one."""
        handle = min(session.handles_on[key])
        candidates: list[tuple[Session, int]] = []
        for peer in peers:
            tensor = peer.tensors.get(handle)
            if tensor is not None and tensor.layout == torch.strided:
                candidates.append((peer, tensor.untyped_storage()._cdata))
        candidates.extend(same_size[:MAX_CANDIDATES])
        tried: set[int] = set()
        for peer, other_key in candidates:
            if other_key in tried or other_key in session.storages or other_key in self.pinned:
                continue
            if other_key in peer.swapped:
                continue
            tried.add(other_key)
            other = _rebindable_storage(peer, other_key)
            if other is None or other.nbytes() != storage.nbytes():
                continue
            self.comparisons += 1
            self.compared_bytes += storage.nbytes()
            if same_bytes(storage, other):
                return other
        return None

    # -- collectives write their outputs ------------------------------------------------------------
    def claim(self, members: Iterable[tuple[Session, Iterable[torch.Tensor]]]) -> set[int]:
        """Before a collective writes these sessions' tensors: own copies, kept out of sharing."""
        keys: set[int] = set()
        with self.device_lock:
            for session, tensors in members:
                for tensor in tensors:
                    if self.memory.shared:
                        session.before_write(tensor)
                    keys.add(tensor.untyped_storage()._cdata)
            for key in keys:
                self.memory.values.pop(key, None)  # their value ids (squash.py) are void
            keys -= self.pinned
            self.pinned |= keys
        return keys

    def share_written(self, members: list[tuple[Session, list[torch.Tensor]]]) -> None:
        """After a collective wrote these sessions' tensors: storages that came out the same as
        another member's (an all_reduce's, a broadcast's results) are kept once."""
        with self.device_lock:
            kept: list[tuple[Session, torch.UntypedStorage]] = []
            for session, tensors in members:
                for tensor in tensors:
                    key = tensor.untyped_storage()._cdata
                    if key not in session.storages or session.storages[key][0] < MIN_SHARED_BYTES:
                        continue
                    if key in session.swapped:
                        continue
                    storage = _rebindable_storage(session, key)
                    if storage is None:
                        continue
                    for other_session, other in kept:
                        if other_session is session or other._cdata in session.storages:
                            continue
                        self.comparisons += 1
                        self.compared_bytes += storage.nbytes()
                        if same_bytes(storage, other):
                            session.repoint(key, other)
                            break
                    else:
                        kept.append((session, storage))

    def share_alike(
        self, writer: Session, written: torch.Tensor, session: Session, tensor: torch.Tensor
    ) -> bool:
        """During a collective that puts the same values into both tensors and has just written
        `written` (the writer's): let the session's `tensor` take the writer's storage instead of
        being written, where that gives it the same bytes (both tensors laid out alike over the
        whole of their storages) and both storages may be shared, as `share_written` would after
        comparing them. Whether it did (if not, the caller writes the tensor)."""
        if session is writer or not (covers_its_storage(written) and covers_its_storage(tensor)):
            return False
        if (written.dtype, written.shape) != (tensor.dtype, tensor.shape):
            return False
        theirs, mine = written.untyped_storage(), tensor.untyped_storage()
        key = mine._cdata
        if theirs._cdata in session.storages or key not in session.storages:
            return False
        if session.storages[key][0] < MIN_SHARED_BYTES or theirs.device != mine.device:
            return False
        with self.device_lock:
            movable = _rebindable_storage(session, key) is not None
            if not movable or _rebindable_storage(writer, theirs._cdata) is None:
                return False
            session.repoint(key, theirs)
        return True

    def release(self, keys: set[int]) -> None:
        """The collective that claimed these storages is done writing them."""
        with self.device_lock:
            self.pinned -= keys
            for key in keys:
                self.memory.values.pop(key, None)

    # -- are the ranks replicas? --------------------------------------------------------------------
    def _long_lived(self, session: Session) -> tuple[int, int]:
        """Bytes of the session's long-lived storages, and of those another session holds too."""
        held = session.storage_of
        keys = {k for h in self._state(session).long_lived if h in held for k in held[h]}
        total = shared = 0
        for key in keys:
            nbytes = session.storages[key][0]
            if nbytes < MIN_SHARED_BYTES:
                continue
            total += nbytes
            if self.memory.is_shared(key):
                shared += nbytes
        return total, shared

    def _judge(self, job_id: str, sessions: list[Session]) -> None:
        """At a collective these ranks of the job wait at: whether they behave like replicas."""
        if min(self._state(s).rounds for s in sessions) < REPLICA_ROUNDS:
            return
        figures: dict[int, tuple[int, int]] = {}
        for session in sessions:  # a rank's sessions of several devices here count together
            total, shared = self._long_lived(session)
            before = figures.get(session.rank, (0, 0))
            figures[session.rank] = (before[0] + total, before[1] + shared)
        if not any(total for total, _shared in figures.values()):
            return
        worst = min(figures, key=lambda r: figures[r][1] / figures[r][0] if figures[r][0] else 1.0)
        total, shared = figures[worst]
        if total == 0 or shared >= REPLICA_SHARE * total:
            self.apart_rounds[job_id] = 0
            held = sum(t for t, _s in figures.values())
            matched = sum(s for _t, s in figures.values())
            self.verdicts[job_id] = (
                "yes",
                f"ranks {', '.join(map(str, sorted(figures)))} hold the same parameters "
                f"({matched} of {held} long-lived bytes shared)",
            )
            return
        self.apart_rounds[job_id] = self.apart_rounds.get(job_id, 0) + 1
        if self.apart_rounds[job_id] < REPLICA_ROUNDS:
            return  # replicas seeded apart differ until their first broadcast (DDP's) lands
        other = min(r for r in figures if r != worst)
        first, second = sorted((worst, other))
        self.verdicts[job_id] = (
            "no",
            f"ranks {first} and {second} hold different parameters: not data-parallel replicas "
            f"(only {shared} of rank {worst}'s {total} long-lived bytes match another rank's)",
        )

    def summary(self, job_id: str, share: bool = True) -> dict[str, Any]:
        """The job's memory on this device (shared and per-rank private bytes) and whether its ranks
        here are data-parallel replicas: "yes", "no" or "unknown", with the reason. With `share`,
        what the ranks hold alike is shared first (else the figures are as the last collective left them).
        "measured" is false while the ranks here have not been compared yet (no collective, quiesce
        or load since they came): then shared_bytes is 0 because nothing was measured."""
        if share:
            self.share_job(job_id)
        sessions = self.job_sessions(job_id)  # read without the device lock: status never waits
        ranks = sorted({s.rank for s in sessions})
        shared: dict[int, int] = {}
        private: dict[str, int] = {}
        for session in sessions:
            mine = 0
            for key, (nbytes, _count) in list(session.storages.items()):
                if self.memory.is_shared(key):
                    shared[key] = nbytes
                else:
                    mine += nbytes
            private[str(session.rank)] = private.get(str(session.rank), 0) + mine
        shared_bytes = sum(shared.values())
        known = [self.ranks.get(s) for s in sessions]
        rounds = min((state.rounds if state else 0 for state in known), default=0)
        replicas, reason = self.verdicts.get(job_id, ("unknown", ""))
        if len(ranks) < 2:
            replicas, reason = "unknown", f"{len(ranks)} rank(s) of job {job_id} on this device"
        elif not reason:
            reason = f"{rounds} of {REPLICA_ROUNDS} rounds of collectives seen"
        return {
            "ranks": ranks,
            "shared_bytes": shared_bytes,
            "private_bytes": private,
            "device_bytes": shared_bytes + sum(private.values()),
            "held_bytes": {
                str(rank): sum(s.held_bytes for s in sessions if s.rank == rank) for rank in ranks
            },
            "rounds": rounds,
            "measured": job_id in self.compared,
            "replicas": replicas,
            "reason": reason,
            "compare_seconds": self.compare_seconds,
            "compared_bytes": self.compared_bytes,
            "copied_bytes": self.memory.copied_bytes,
        }

    def forget(self, job_id: str) -> None:
        """Drop the verdict of a job whose sessions are gone."""
        self.verdicts.pop(job_id, None)
        self.apart_rounds.pop(job_id, None)
        self.partial_rounds.pop(job_id, None)
        self.compared.discard(job_id)
