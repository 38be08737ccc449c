"""Collectives of a job's processes, carried out by the job's proxy servers, never by the job.

A process's collective (`OP_COLLECTIVE`) runs in its session's thread (runner.py) when the
session reaches it, in order with its other operations. The ranks whose collectives of a group
run on this device are reduced here; the other devices' servers are reached over the job's
links (links.py). Results never depend on how the ranks are spread over devices: reductions
fold the ranks' values in global rank order (collective_kinds.py).

How an instance (job, group, seq) runs on one server:
1. *Placement*: the first collective of a rank in a group tells every other server of the job
   which device runs that rank's collectives (PEER_PLACE); an instance starts once every member
   is placed. A rank keeps its device for a group.
2. *Arrival*: each local member registers; the last local member to arrive drives the instance
   for all of them: it sends the parts other servers need (PEER_PIECE), waits for the parts it
   needs, computes, and writes every local member's outputs. Until then the others wait.
3. An instance that cannot complete fails in every member with the reason: a member's process
   ended before reaching it (PEER_GONE tells how far each ended rank got), or a server it needs
   is gone. Nothing waits for a dead rank.

Consistent cut: no server completes an instance before every member has arrived, not even one
that needs no data from the others (a broadcast's root: collective_kinds.with_arrivals), and
then it completes everywhere without waiting for anything else. So when every session of the job is
idle (runner.Runner.idle) and no link message is in flight (`settle`), each instance is either
complete for all its members or not started for any (its collective is still first in the
waiting sessions' queues, which the checkpoint saves); the pieces already received for such an
instance are dropped, since its members send them again after a restore.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from singularity.proxy.bootstrap._singularity_proxy import protocol
from singularity.proxy.bootstrap._singularity_proxy.protocol import ProtocolError

from . import operators
from .dedup import Dedup
from .links import PeerLink
from .pace import Pace
from .session import Session, rebindable
from .squash import Squash

SWAP_MIN_BYTES = 64 << 10
"""Smallest storage a waiting member moves to host memory (smaller ones are not worth a copy)."""
READS_FROM_HOST = frozenset({"allreduce"})
"""Kinds whose driver reads a waiting member's tensors from host memory (collective_kinds.py):
their members move their own collective tensors off the device too."""
MAX_GROUP_SIZE = 4096
"""Most members of a process group (the daemon's limit on a job's ranks)."""
SETTLE_POLL_SECONDS = 0.05
"""How often `settle` looks again without being told (a change that notifies nobody)."""
_NAMES = protocol.torch_names()
_TENSOR_KEYS = ("tensors", "inputs", "outputs")


@dataclass
class Instance:
    """One collective of a group (job, group, seq) as this server sees it."""

    job: str
    group: str
    seq: int
    operator: str = ""
    members: list[int] = field(default_factory=list)
    placement: list[int] = field(default_factory=list)
    """The device index of each group rank."""
    locals: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Group rank -> the parameters of a member that runs here (its tensors resolved)."""
    sessions: dict[int, Session] = field(default_factory=dict)
    """Group rank -> the session of a member that runs here."""
    pieces: dict[tuple[Any, ...], torch.Tensor] = field(default_factory=dict)
    """Parts of other servers' data received for this instance, by key."""
    driving: bool = False
    done: bool = False
    failure: str = ""


def _resolve(session: Any, value: Any) -> Any:
    """A spec's handle, or (nested) list of handles, as the session's tensors."""
    if type(value) is list:
        return [_resolve(session, item) for item in value]
    return session.tensor(value)


def _tensors_of(params: dict[str, Any], names: Sequence[str] = _TENSOR_KEYS) -> list[torch.Tensor]:
    """The tensors a member gives a collective under these names (all of them by default)."""
    found: list[torch.Tensor] = []
    stack: list[Any] = [params.get(name, []) for name in names]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif type(value) is list:
            stack.extend(value)
    return found


def _written(params: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors of a member that a collective may write (its tensors and outputs)."""
    return _tensors_of(params, ("tensors", "outputs"))


def parse_spec(session: Any, spec: Any, size: int) -> dict[str, Any]:
    """A collective's spec with its handles resolved; ProtocolError for anything malformed."""
    if type(spec) is not dict or not set(spec) <= set(protocol.COLLECTIVE_SPEC):
        raise ProtocolError(f"malformed collective spec {str(spec)[:100]}")
    params = dict(spec)
    for key in _TENSOR_KEYS:
        value = params.get(key, [])
        if type(value) is not list or len(value) > protocol.MAX_BUFFERS:
            raise ProtocolError(f"collective {key} must be a list")
        params[key] = _resolve(session, value)
    op = params.setdefault("op", "sum")
    if op not in protocol.REDUCE_OPS:
        raise ValueError(f"proxy: unknown reduction {op!r}")
    params["factor"] = protocol.number(params.get("factor", 1.0))
    params["root"] = protocol.integer(params.get("root", 0), 0, size - 1)
    for key in ("input_splits", "output_splits"):
        params[key] = protocol.integers(params.get(key, []), most=size)
    return params


class Member(Protocol):
    """What a collective needs of a session's runner (runner.Runner): who it is, the groups it is in,
    how far it got in each, a wait that ends when its session does, whether it can go on, and
    what it does once it stopped using the device for the collective (gives its turn up), and the
    turns of its job's ranks here (pace.py: while they take turns, a member that waits for others
    moves what it alone holds to host memory)."""

    session: Session
    pace: Pace
    groups: dict[str, tuple[int, list[int]]]
    last_seq: dict[str, int]

    @property
    def global_rank(self) -> int: ...

    def wait(self, ready: Callable[[], bool]) -> None: ...

    def idle(self) -> bool: ...

    def arrived(self) -> None: ...


Kind = Callable[["Exchange"], None]
"""A collective's driver, run once per server and instance (collective_kinds.py)."""


class Collectives:
    """The collectives of the jobs served here, and the links to the other servers of the job."""

    def __init__(self, index: int, device: torch.device, device_lock: Any, kinds: dict[str, Kind]) -> None:
        self.index = index
        self.kinds = kinds
        """The collective kinds served, by name."""
        """This server's device index within its job (cuda:index)."""
        self.device = device
        self.device_lock = device_lock
        """Held while a collective computes on the device (the executor's lock)."""
        self.lock = threading.RLock()
        """Guards everything below and every session's queue (runner.py)."""
        self.cond = threading.Condition(self.lock)
        """Tells every waiter here that something under the lock changed."""
        self.resting = threading.Condition(self.lock)
        """Notified when a session's runner may have come to rest (its frame done, or waiting in a
        collective): what `settle` waits on, so a consistent cut is seen as soon as it is reached."""
        self.links: dict[int, PeerLink] = {}
        self.lost: set[int] = set()
        """Device indices whose server is gone."""
        self.placements: dict[tuple[str, str], dict[int, int]] = {}
        """(job, group) -> {global rank: device index}."""
        self.instances: dict[tuple[str, str, int], Instance] = {}
        self.gone: dict[str, dict[int, dict[str, int]]] = {}
        """job -> {ended global rank: {group: the last collective it reached}}."""
        self.events = 0
        """Changes so far (queues, collectives, messages): unchanged between two looks means quiet."""
        self.squash: Squash | None = None
        """Operations of spliced ranks run once (squash.py): what every rank passed is forgotten."""
        self.dedup: Dedup | None = None
        """Storages shared across the ranks here (dedup.py): compared when a rank reaches a
        collective, copied before a collective writes them."""

    # -- links -------------------------------------------------------------------------------------
    def connect(self, peers: dict[int, Any]) -> None:
        """Take the links to the other servers of the job ({device index: socket}) and read them."""
        for index, sock in peers.items():
            link = PeerLink(index, sock)
            self.links[index] = link
            link.start(self._deliver, self._lost)

    def _lost(self, link: PeerLink) -> None:
        with self.cond:
            self.lost.add(link.index)
            self.events += 1
            self.cond.notify_all()

    def _broadcast(self, kind: int, body: Any) -> None:
        """Send a small message to every other server of the job (those gone are skipped)."""
        for link in list(self.links.values()):
            try:
                link.send(kind, body)
            except OSError:
                self._lost(link)

    def _deliver(self, link: PeerLink, frame: protocol.Frame) -> None:
        """Apply one message from another server."""
        body = frame.decode()
        if frame.kind == protocol.PEER_PIECE:
            job, group, seq, key, dtype, shape, operator, _numel = body
            stride = torch.empty(shape, device="meta").stride() if shape else []
            tensor = protocol.tensor_from_raw(dtype, shape, list(stride), frame.buffers[0])
        with self.cond:
            if frame.kind == protocol.PEER_PLACE:
                job, group, rank, index = body
                self.placements.setdefault((job, group), {}).setdefault(rank, index)
            elif frame.kind == protocol.PEER_PIECE:
                instance = self._instance(job, group, seq)
                if instance.operator and operator != instance.operator:
                    instance.failure = _mismatch(group, seq, instance.operator, operator)
                instance.operator = instance.operator or operator
                instance.pieces[tuple(key)] = tensor
            elif frame.kind == protocol.PEER_GONE:
                job, rank, lasts = body
                self._record_gone(job, rank, lasts)
            link.received += 1
            self.events += 1
            self.cond.notify_all()

    def _instance(self, job: str, group: str, seq: int) -> Instance:
        key = (job, group, seq)
        found = self.instances.get(key)
        if found is None:
            found = self.instances[key] = Instance(job, group, seq)
        return found

    # -- ranks that ended --------------------------------------------------------------------------
    def _record_gone(self, job: str, rank: int, lasts: dict[str, int]) -> None:
        known = self.gone.setdefault(job, {}).setdefault(rank, {})
        for group, last in lasts.items():
            known[group] = max(known.get(group, -1), last)

    def rank_gone(self, runner: Member) -> None:
        """A session's process ended: fail what waits for it, here and on the other servers."""
        job, rank = runner.session.job_id, runner.global_rank
        lasts = {group: runner.last_seq.get(group, -1) for group in runner.groups}
        with self.cond:
            self._record_gone(job, rank, lasts)
            self.events += 1
            self.cond.notify_all()
        self._broadcast(protocol.PEER_GONE, [job, rank, lasts])

    def _doomed(self, job: str, group: str, seq: int, members: Sequence[int]) -> str:
        """Why collective `seq` of the group can never complete ('' if it still can)."""
        gone = self.gone.get(job, {})
        table = self.placements.get((job, group), {})
        for rank in members:
            ended = gone.get(rank)
            if ended is None:
                continue
            if rank not in table or (group in ended and ended[group] < seq):
                return (
                    f"proxy: rank {rank} ended before it reached collective {seq} of process group "
                    f"{group!r}; the collective cannot complete"
                )
        used = {table[r] for r in members if r in table}
        lost = used & self.lost if len(table) >= len(members) else self.lost
        if lost:
            server = f"the server of cuda:{min(lost)} of job {job}"
            return f"proxy: {server} is gone; collective {seq} cannot complete"
        return ""

    # -- running a collective ----------------------------------------------------------------------
    def run(self, runner: Member, args: Any) -> None:
        """Run one collective of the session (from its thread); raises what made it fail."""
        if type(args) is not list or len(args) != 4:
            raise ProtocolError("a collective is [group, seq, operator, spec]")
        group, seq, operator, spec = args
        if type(group) is not str or type(seq) is not int or type(operator) is not str:
            raise ProtocolError("a collective names its group, sequence number and operator")
        kind = operators.collective_kind(operator)
        defined = runner.groups.get(group)
        if defined is None:
            raise ProtocolError(f"process group {group!r} was not defined")
        me, members = defined
        params = parse_spec(runner.session, spec, len(members))
        if self.dedup is not None:
            self.dedup.at_collective(runner.session, _written(params))
        if self.squash is not None:
            with self.device_lock:  # it may let kept storages go: the device's counts change
                self.squash.at_collective(runner.session.job_id)
        job = runner.session.job_id
        placement = self._place(runner, job, group, me, members)
        if runner.session.swapped and kind not in READS_FROM_HOST:
            with self.device_lock:  # what the driver reads and writes of this member is on the device
                runner.session.swap_in_tensors(_tensors_of(params))
        spliced = runner.pace.enabled and placement.count(self.index) > 1
        if spliced and self._will_wait(job, group, seq, placement):
            self._move_off(runner.session, params, kind)
        runner.arrived()
        with self.cond:
            if seq <= runner.last_seq.get(group, -1):
                raise ProtocolError(
                    f"collective {seq} of group {group!r} comes after {runner.last_seq[group]}"
                )
            runner.last_seq[group] = seq
            instance = self._instance(job, group, seq)
            if instance.operator and instance.operator != operator:
                instance.failure = instance.failure or _mismatch(group, seq, instance.operator, operator)
            instance.operator = instance.operator or operator
            instance.members, instance.placement = list(members), placement
            instance.locals[members.index(me)] = params
            instance.sessions[members.index(me)] = runner.session
            self.events += 1
            self.cond.notify_all()
            if len(instance.locals) < placement.count(self.index):
                runner.wait(lambda: instance.done or bool(self._failure(instance)))
                if not instance.done:
                    raise RuntimeError(self._failure(instance))
                return
            instance.driving = True
        claimed: set[int] = set()
        written = [(instance.sessions[rank], _written(instance.locals[rank])) for rank in instance.locals]
        try:
            if self.dedup is not None:
                self.dedup.at_round(list(instance.sessions.values()))
                claimed = self.dedup.claim(written)
            self.kinds[kind](Exchange(self, instance, runner))
            if self.dedup is not None and len(written) > 1:
                self.dedup.share_written(written)
        except Exception as e:
            with self.cond:
                instance.failure = instance.failure or str(e)
            raise
        finally:
            if claimed and self.dedup is not None:
                self.dedup.release(claimed)
            with self.cond:
                instance.done = not instance.failure
                if self.instances.get((job, group, seq)) is instance:
                    del self.instances[(job, group, seq)]
                self.events += 1
                self.cond.notify_all()

    def _will_wait(self, job: str, group: str, seq: int, placement: list[int]) -> bool:
        """Whether a member arriving now at this instance waits for other members here."""
        with self.cond:
            found = self.instances.get((job, group, seq))
            arrived = 0 if found is None else len(found.locals)
            return arrived + 1 < placement.count(self.index)

    def _move_off(self, session: Session, params: dict[str, Any], kind: str) -> None:
        """Before a member waits for the other ranks of its job on this device (spliced), move the
        storages it alone holds to host memory, so that the device holds the private state of
        the ranks that run, not of those that wait (their bytes come back when next used:
        Session.swap_in; squashing brings back one it hands to another rank: squash.py
        `_storage`). What others may read stays: shared storages, those a collective writes, and
        the member's collective tensors unless the driver reads them from host memory."""
        keep: set[int] = set()
        if kind not in READS_FROM_HOST:
            keep = {tensor.untyped_storage()._cdata for tensor in _tensors_of(params)}
        memory = session.memory
        pinned = self.dedup.pinned if self.dedup is not None else set()
        with self.device_lock:
            for key, (nbytes, _count) in list(session.storages.items()):
                if nbytes < SWAP_MIN_BYTES or key in keep or key in session.swapped or key in pinned:
                    continue
                if memory.is_shared(key):
                    continue
                if all(rebindable(session.tensors[h]) for h in session.handles_on[key]):
                    session.swap_out(key)

    def _failure(self, instance: Instance) -> str:
        """Why an instance failed or cannot complete ('' while it still can)."""
        return instance.failure or self._doomed(instance.job, instance.group, instance.seq, instance.members)

    def _place(self, runner: Member, job: str, group: str, me: int, members: list[int]) -> list[int]:
        """The device of every member's collectives in the group (announcing this rank's first)."""
        with self.cond:
            table = self.placements.setdefault((job, group), {})
            placed = table.get(me)
            if placed is None:
                table[me] = self.index
            elif placed != self.index:
                raise RuntimeError(
                    f"proxy: rank {me} ran collectives of process group {group!r} on cuda:{placed} and now "
                    f"on cuda:{self.index}: a rank keeps one device for the collectives of a group"
                )
        if placed is None:
            self._broadcast(protocol.PEER_PLACE, [job, group, me, self.index])
        with self.cond:
            if not all(rank in table for rank in members):
                runner.wait(
                    lambda: (
                        all(rank in table for rank in members) or bool(self._doomed(job, group, 0, members))
                    )
                )
            if not all(rank in table for rank in members):
                raise RuntimeError(self._doomed(job, group, 0, members))
            return [table[rank] for rank in members]

    # -- the data of a collective ------------------------------------------------------------------
    def send_piece(self, instance: Instance, index: int, key: tuple[Any, ...], tensor: torch.Tensor) -> None:
        """Send a part of this server's data for the instance to the server of cuda:index."""
        link = self.links.get(index)
        if link is None:
            raise RuntimeError(f"proxy: no link from cuda:{self.index} to cuda:{index} in this job")
        host = tensor.detach().to("cpu").contiguous()
        data = protocol.storage_view(host)[host.storage_offset() * host.element_size() :][: host.nbytes]
        body = [
            instance.job, instance.group, instance.seq, list(key), _NAMES.dtype_names[host.dtype],
            list(host.shape), instance.operator, host.numel(),
        ]  # fmt: skip
        try:
            link.send(protocol.PEER_PIECE, body, [data])
        except OSError:
            self._lost(link)
            raise RuntimeError(f"proxy: the server of cuda:{index} is gone") from None

    def wait_pieces(
        self, runner: Member, instance: Instance, keys: set[tuple[Any, ...]]
    ) -> dict[Any, torch.Tensor]:
        """The parts other servers sent for the instance under these keys (waiting for them)."""
        pieces = instance.pieces
        with self.cond:
            runner.wait(lambda: keys <= pieces.keys() or bool(self._failure(instance)))
            failure = self._failure(instance)
            if failure:
                raise RuntimeError(failure)
            return {key: pieces.pop(key).to(self.device) for key in keys}

    # -- consistent cuts ---------------------------------------------------------------------------
    def settle(self, runners: Sequence[Member], timeout: float) -> dict[str, Any]:
        """Wait (up to `timeout`) until nothing of these sessions can run; what the daemon compares.

        Returns whether they are all idle, the count of changes, and the messages sent to and
        taken from each other server: two equal answers from every server of a job, all idle and
        with as many messages taken as sent on every link, mean a consistent cut.
        """
        deadline = time.monotonic() + timeout
        with self.cond:
            while not all(runner.idle() for runner in runners):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.resting.wait(min(left, SETTLE_POLL_SECONDS))
            return {
                "idle": all(runner.idle() for runner in runners),
                "events": self.events,
                "sent": {str(i): link.sent for i, link in self.links.items()},
                "received": {str(i): link.received for i, link in self.links.items()},
            }

    def forget(self, job: str) -> None:
        """Drop what this server knows of the job's collectives (its sessions are gone)."""
        with self.cond:
            for key in [k for k in self.instances if k[0] == job]:
                del self.instances[key]
            for place in [k for k in self.placements if k[0] == job]:
                del self.placements[place]
            self.gone.pop(job, None)


def _mismatch(group: str, seq: int, first: str, second: str) -> str:
    return (
        f"proxy: mismatched collectives: collective {seq} of process group {group!r} is {first} "
        f"on one rank and {second} on another"
    )


class Exchange:
    """What a collective's driver uses: the members, where they run, and the other servers."""

    def __init__(self, collectives: Collectives, instance: Instance, runner: Member) -> None:
        self.collectives = collectives
        self.instance = instance
        self.runner = runner
        self.me = collectives.index
        self.size = len(instance.members)
        self.placement = instance.placement
        self.servers = sorted(set(instance.placement))
        """Device indices running members of this collective."""
        self.local = sorted(instance.locals)
        """Group ranks of the members running here."""
        self.params = instance.locals
        first = instance.locals[self.local[0]]
        self.op: str = first["op"]
        self.factor: float = first["factor"]
        self.root: int = first["root"]
        self.device_lock = collectives.device_lock

    def send(self, index: int, key: tuple[Any, ...], tensor: torch.Tensor) -> None:
        """Send a part of this server's data to the server of cuda:index."""
        self.collectives.send_piece(self.instance, index, key, tensor)

    def wait(self, keys: set[tuple[Any, ...]]) -> dict[Any, torch.Tensor]:
        """The parts received under these keys (waiting for them)."""
        if not keys:
            return {}
        return self.collectives.wait_pieces(self.runner, self.instance, keys)
