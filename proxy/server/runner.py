"""Each session's queue of received work, and the thread that runs it in order.

The reader of a job connection (service.py) only reads: every frame goes into its session's
queue whatever the session is doing, so a process that parks has all it sent on the server
even while one of its collectives waits for another rank. One executor thread per session runs
the queue in order: plain operations under the device lock (executor.py), collectives through
the job's collectives (collectives.py), where the thread may wait without holding the lock.

For a checkpoint, a session is *idle* when nothing in it can run: its queue is empty, or its
thread waits for a collective that cannot complete yet. Its unfinished work (from the waiting
collective on) is saved with the device state and runs after a restore (`saved_queue`).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from singularity.proxy.bootstrap._singularity_proxy import protocol
from singularity.proxy.bootstrap._singularity_proxy.protocol import ProtocolError

from .collectives import MAX_GROUP_SIZE, Collectives
from .pace import Pace
from .session import Session, exception_info

if TYPE_CHECKING:
    from .executor import Executor

QUEUE_BYTES = 256 << 20
"""Bytes of frames a session's queue holds before its reader stops reading (until a park)."""


class Stopped(Exception):
    """The session ended while its thread waited."""


class Work:
    """One frame from the job: operations (run from `position` on), maybe a request, the buffers."""

    __slots__ = ("answer", "buffers", "failure", "nbytes", "ops", "position", "request")

    def __init__(
        self,
        ops: list[Any],
        request: Any,
        buffers: list[Any],
        *,
        answer: bool,
        failure: BaseException | None = None,
    ) -> None:
        self.ops = ops
        self.position = 0
        self.request = request
        self.answer = answer
        """Whether the job waits for an answer (a REQUEST frame)."""
        self.buffers = buffers
        self.nbytes = sum(memoryview(b).nbytes for b in buffers)
        self.failure = failure
        """Why the frame could not be taken (reported in order, like an operation's failure)."""

    def saved(self) -> list[Any]:
        """What is left of it, for a checkpoint: [operations, request, answer, buffers as bytes]."""
        return [self.ops[self.position :], self.request, self.answer, [bytes(b) for b in self.buffers]]

    @classmethod
    def restored(cls, saved: Any) -> Work:
        """A frame saved by `saved`; ProtocolError if it is not one."""
        if type(saved) is not list or len(saved) != 4 or type(saved[0]) is not list:
            raise ProtocolError("not a saved frame")
        ops, request, answer, buffers = saved
        return cls(ops, request, [memoryview(bytearray(b)) for b in buffers], answer=bool(answer))


def is_collective(op: Any) -> bool:
    """Whether an operation of a batch belongs to the collectives (run outside the device lock)."""
    return type(op) is list and bool(op) and op[0] in (protocol.OP_COLLECTIVE, protocol.OP_GROUP)


def defined_group(op: Any) -> tuple[str, int, list[int]]:
    """An OP_GROUP's process group: its name, the process's global rank in it, its members."""
    if type(op) is not list or len(op) != 4:
        raise ProtocolError("a process group is [OP_GROUP, name, rank, members]")
    _, name, rank, members = op
    ranks = protocol.integers(members, most=MAX_GROUP_SIZE)
    if type(name) is not str or not ranks or len(set(ranks)) != len(ranks):
        raise ProtocolError("a process group is a name and distinct member ranks")
    if protocol.integer(rank) not in ranks:
        raise ProtocolError(f"rank {rank} is not a member of process group {name!r}")
    return name, rank, ranks


class Runner:
    """The queue of one session and its executor thread."""

    def __init__(
        self,
        session: Session,
        executor: Executor,
        collectives: Collectives,
        saved_queue: list[Any] | None = None,
        groups: dict[str, tuple[int, list[int]]] | None = None,
        pace: Pace | None = None,
    ) -> None:
        self.session = session
        self.executor = executor
        self.collectives = collectives
        self.pace = pace or Pace()
        """The turns of the job's spliced ranks on this device (pace.py)."""
        self.rounds = 0
        """Collectives, collective requests and process groups defined that the session went past."""
        self.ran = 0
        """Operations the session ran since the last of them."""
        self.idle_since = 0.0
        """When the session last finished a frame (by time.monotonic)."""
        self.cond = collectives.cond
        """The server-wide condition: queues, waits and collectives change under it."""
        self.has_work = threading.Condition(collectives.lock)
        """Wakes this session's thread alone when it may have work (queued, released, stopping): an
        idle thread is not woken by every message of the other sessions here."""
        self.turn = threading.Condition(collectives.lock)
        """Wakes this session's thread alone while it waits for its turn (pace.py)."""
        self.queue: collections.deque[Work] = collections.deque(
            Work.restored(item) for item in saved_queue or []
        )
        self.queued_bytes = sum(work.nbytes for work in self.queue)
        self.groups: dict[str, tuple[int, list[int]]] = dict(groups or {})
        """Process groups the session takes part in: name -> (its global rank, members)."""
        self.last_seq: dict[str, int] = {}
        """The last collective of each group this session reached (for the other servers, if it dies)."""
        self.held = saved_queue is not None
        """A restored session runs nothing until the daemon resumes it."""
        self.busy = False
        self.waiting_on: Callable[[], bool] | None = None
        """While the thread waits in a collective: whether it can go on."""
        self.stopping = False
        self.thread = threading.Thread(
            target=self._loop, name=f"sing-run-{session.job_id}/{session.rank}", daemon=True
        )
        self.thread.start()

    @property
    def global_rank(self) -> int:
        """The process's global rank (from its groups; else the rank it said hello with)."""
        for rank, _members in self.groups.values():
            return rank
        return self.session.rank

    # -- the reader's side -------------------------------------------------------------------------
    def put(self, work: Work) -> None:
        """Queue a frame; wait while the queue is full (never while the daemon parks the process)."""
        with self.cond:
            self.queue.append(work)
            self.queued_bytes += work.nbytes
            self.collectives.events += 1
            self.has_work.notify()
            self.cond.notify_all()
            while self.queued_bytes > QUEUE_BYTES and not self.stopping and not self.session.park_asked:
                self.cond.wait(0.1)

    # -- state for the daemon ----------------------------------------------------------------------
    def idle(self) -> bool:
        """Whether nothing of this session can run now (call with the condition held)."""
        if self.held or self.stopping:
            return True
        if self.waiting_on is not None:
            return not self.waiting_on()
        return not self.busy and not self.queue

    def release_hold(self) -> None:
        """Let a restored session run its queue."""
        with self.cond:
            self.held = False
            self.has_work.notify()
            self.cond.notify_all()

    def saved_queue(self) -> list[Any]:
        """The session's unfinished frames, for a checkpoint (call when idle)."""
        with self.cond:
            return [work.saved() for work in self.queue if work.position < len(work.ops) or work.answer]

    def finish(self) -> None:
        """Wait until the session has run everything its ended process sent (a GPU finishes what a
        process launched before it ended); a collective that can never complete fails instead."""
        with self.cond:
            while not self.stopping and not self.held and (self.busy or self.queue):
                self.cond.wait(1.0)

    def stop(self, timeout: float = 30.0) -> None:
        """End the thread (after the operation it runs) and forget the queue."""
        with self.cond:
            self.stopping = True
            self.queue.clear()
            self.queued_bytes = 0
            self.has_work.notify()
            self.cond.notify_all()
            self.pace.went_idle(self)
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    def arrived(self) -> None:
        """The session reached a collective, its private storages off the device: the other
        ranks of its job here may take their turn."""
        self.pace.give_turn(self)

    def wait(self, ready: Callable[[], bool]) -> None:
        """Wait (with the condition held) until `ready()`; Stopped if the session ends first."""
        self.waiting_on = ready
        if not ready():
            self.pace.waits(self)  # once: two waiting threads must not wake each other forever
            self.collectives.resting.notify_all()
        try:
            while not ready():
                if self.stopping:
                    raise Stopped(f"proxy: the session of rank {self.session.rank} ended")
                self.cond.wait()
        finally:
            self.waiting_on = None

    # -- the executor thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(True)  # some kernels (mkldnn RNN) keep state only then
        pin_intra_op_threads()
        while True:
            with self.cond:
                # no notify while waiting: two idle sessions' threads would wake each other forever
                while not self.stopping and (self.held or not self.queue):
                    self.has_work.wait()
                if self.stopping:
                    return
                self.busy = True
                work = self.queue[0]
            try:
                self._execute(work)
            except Stopped:
                return
            with self.cond:
                if self.queue and self.queue[0] is work:
                    self.queue.popleft()
                    self.queued_bytes -= work.nbytes
                self.busy = False
                self.idle_since = time.monotonic()
                self.collectives.events += 1
                self.cond.notify_all()
                self.collectives.resting.notify_all()
                self.pace.went_idle(self)

    def _execute(self, work: Work) -> None:
        """Run a frame: its operations, then its request (answering the job)."""
        session = self.session
        if work.failure is not None:
            if work.answer:
                self._reply(protocol.ERROR, exception_info(work.failure))
            else:
                session.fail(work.failure)
            return
        ops = work.ops
        while work.position < len(ops):
            if self.stopping:
                raise Stopped("stopped")
            if is_collective(ops[work.position]):
                try:
                    op = ops[work.position]
                    if op[0] == protocol.OP_GROUP:
                        name, rank, members = defined_group(op)
                        self.groups[name] = (rank, members)
                    else:
                        self.collectives.run(self, op[1:])
                except Stopped:
                    raise
                except Exception as e:
                    session.fail(e)
                self.pace.passed_collective(self)
                work.position += 1
                continue
            end = work.position
            while end < len(ops) and not is_collective(ops[end]):
                end += 1
            pauses = self.pace.pauses(self)
            while work.position < end:
                self.pace.take_turn(self)
                if self.stopping:
                    raise Stopped("stopped")
                reached = self.executor.run_ops(session, ops, work.position, end, work.buffers, pauses)
                self.pace.ran(self, reached - work.position)
                work.position = reached
                if reached < end:
                    self.pace.give_turn(self)
        self.executor.batches += 1
        if not work.answer:
            return
        try:
            request = work.request
            if type(request) is list and request and request[0] == protocol.REQ_COLLECTIVE:
                session.raise_pending()
                try:
                    self.collectives.run(self, request[1:])
                finally:
                    self.pace.passed_collective(self)
                session.raise_pending()
                value = None
            else:
                value = self.executor.answer(session, request, work.buffers)
        except Stopped:
            raise
        except Exception as e:
            self._reply(protocol.ERROR, exception_info(e))
            return
        self._reply(protocol.REPLY, value)

    def _reply(self, kind: int, value: Any) -> None:
        """Answer the process (dropped if it is gone)."""
        connection = self.session.connection
        if connection is None:
            return
        try:
            connection.send(kind, value)  # encodes fully before writing anything
        except OSError:
            return
        except Exception as e:
            with contextlib.suppress(OSError):
                connection.send(protocol.ERROR, exception_info(e))


def pin_intra_op_threads() -> None:
    """Give the calling thread the server's intra-op thread count (torch.set_num_threads).

    torch gives a new thread that count only once it asks for it; until then kernels such as
    `mm` run with OpenMP's default, and their low bits depend on how many threads computed them.
    A session's thread would then compute differently from the one before a checkpoint until
    some kernel asked, and a restored job would not be exact.
    """
    torch.get_num_threads()
