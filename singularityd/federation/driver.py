"""The hand-off driver: runs the pure machine (`handoff`) against a store, the peer RPCs and the daemon.

For every stimulus of a job (one at a time per job): load its holding, `decide`, store the new
holding, then carry the actions out. Requests to peers, stopping the job, sending its checkpoint
and restoring it run as tasks whose outcome comes back as the next stimulus, so the machine, not
the caller, decides what an outcome means. A peer's request waits for the machine's Reply.

What the daemon supplies is small: a `HoldingStore` (durable), and `MoveWork` (its job-side
effects, each idempotent, serialised per job by the daemon's own job lock).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import grpc.aio

from singularityd.federation import handoff as h
from singularityd.federation.peer import PeerChannels, Refused
from singularityd.federation.v1 import peer_pb2 as pb
from singularityd.federation.v1 import peer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

STEP_TO_PB = {
    h.Step.PREPARE: pb.PREPARE,
    h.Step.RESTORE: pb.RESTORE,
    h.Step.COMMIT: pb.COMMIT,
    h.Step.ABORT: pb.ABORT,
}
PB_TO_STEP = {v: k for k, v in STEP_TO_PB.items()}
CONNECT_RETRY_FIRST_S = 0.25
CONNECT_RETRY_MAX_S = 2.0
"""The pauses between PREPARE's attempts to reach a target that refuses connections: doubling
from the first to the longest (gRPC's channel reconnects on its own backoff meanwhile)."""


def boot_clock() -> float:
    """Seconds since boot, suspended time included: a clock that never jumps, for deadlines and holds
    (a hold that one node measures must not end later, by the wall, than its peer reckons)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


class HoldingStore(Protocol):
    """Where holdings live; `save` must be durable when it returns."""

    def load(self, job_id: str) -> h.Holding | None:
        """The job's holding here, if any."""
        ...

    def save(self, holding: h.Holding) -> None:
        """Store a holding durably (before any of its actions is carried out)."""
        ...

    def all(self) -> Iterable[h.Holding]:
        """Every holding (for ticks and recovery)."""
        ...


class MoveWork(Protocol):
    """The daemon's side of a move; every method is idempotent and may raise to report failure."""

    def spec_json(self, job_id: str) -> bytes:
        """The PREPARE spec of a job owned here (see `hosting.MoveSpec`)."""
        ...

    async def host_problem(self, job_id: str, spec_json: bytes) -> str:
        """Why this node cannot take the job ('' when it can; see `hosting.hosting_problem`)."""
        ...

    async def stop_for_move(self, job_id: str, epoch: int) -> None:
        """Stop the job with a complete final checkpoint (a stopped job with one is already done)."""
        ...

    async def send_checkpoint(self, job_id: str, peer: str, epoch: int) -> None:
        """Transfer the checkpoint to `peer` (see `transfer_grpc.Sending`)."""
        ...

    async def resume_here(self, job_id: str) -> None:
        """If the job is stopped for a move, let it run here again."""
        ...

    async def drop_local_copy(self, job_id: str, peer: str) -> None:
        """The job lives on `peer` now: delete its checkpoint here, mark it moved."""
        ...

    async def restore_frozen(self, job_id: str, epoch: int) -> None:
        """Restore the checkpoint received for `epoch` with the job's processes stopped."""
        ...

    async def release_frozen(self, job_id: str, epoch: int) -> None:
        """Let the processes restored for `epoch` run (nothing if they already do)."""
        ...

    async def discard_incoming(self, job_id: str, epoch: int) -> None:
        """Kill what was restored for `epoch` and delete what was received for it."""
        ...

    def note(self, job_id: str, text: str) -> None:
        """Record an event in the job's log."""
        ...


class Unreachable(Exception):
    """A peer could not be reached for as long as a step keeps trying; the message says which."""


@dataclass
class MemoryStore:
    """Holdings in a dict: for tests and simulations (not durable)."""

    holdings: dict[str, h.Holding] = field(default_factory=dict)

    def load(self, job_id: str) -> h.Holding | None:
        """See HoldingStore."""
        return self.holdings.get(job_id)

    def save(self, holding: h.Holding) -> None:
        """See HoldingStore."""
        self.holdings[holding.job_id] = holding

    def all(self) -> Iterable[h.Holding]:
        """See HoldingStore."""
        return list(self.holdings.values())


@dataclass
class Handoffs:
    """Drives every job's hand-offs on one daemon; also the peer service's HandoffHandler."""

    store: HoldingStore
    work: MoveWork
    channels: PeerChannels
    address_of: Callable[[str], str]
    settings: h.Settings = field(default_factory=h.Settings)
    clock: Callable[[], float] = boot_clock
    """Deadlines and holds are measured on it (see `boot_clock`)."""
    rpc_timeout_s: float = 30.0
    restore_timeout_s: float = 600.0
    connect_retry_s: float = 10.0
    """How long PREPARE keeps trying to reach a target it cannot connect to (a daemon restarting)."""
    _locks: dict[str, asyncio.Lock] = field(default_factory=lambda: defaultdict(asyncio.Lock))
    _replies: dict[tuple[str, h.Step, int], list[asyncio.Future[h.Reply]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    _moves: dict[str, list[asyncio.Future[h.MoveFinished]]] = field(default_factory=lambda: defaultdict(list))
    """The callers of `move` waiting for each job's move to end (a refused caller leaves at once)."""
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    @property
    def busy(self) -> bool:
        """Whether requests or local work are in flight."""
        return bool(self._tasks)

    async def move(self, job_id: str, target: str) -> h.MoveFinished:
        """Move a job owned here to `target`; return how it ended (InvalidRequest when not allowed)."""
        finished: asyncio.Future[h.MoveFinished] = asyncio.get_running_loop().create_future()
        self._moves[job_id].append(finished)
        try:
            await self.feed(job_id, h.MoveRequested(target))
        except h.InvalidRequest:
            waiting = self._moves.get(job_id, [])
            if finished in waiting:
                waiting.remove(finished)
            if not waiting:
                self._moves.pop(job_id, None)
            raise
        return await finished

    async def handoff(self, node: str, request: pb.HandoffRequest) -> pb.HandoffReply:
        """A peer's hand-off step: feed it to the machine and answer with its Reply."""
        step = PB_TO_STEP.get(request.step)
        if step is None or not request.job_id:
            raise Refused("a hand-off request needs a job id and a step")
        stimulus: h.Stimulus
        match step:
            case h.Step.PREPARE:
                problem = await self.work.host_problem(request.job_id, request.spec_json)
                stimulus = h.PrepareReceived(node, request.epoch, problem, request.hold_seconds)
            case h.Step.RESTORE:
                stimulus = h.RestoreReceived(node, request.epoch)
            case h.Step.COMMIT:
                stimulus = h.CommitReceived(node, request.epoch)
            case h.Step.ABORT:
                stimulus = h.AbortReceived(node, request.epoch)
        waiter: asyncio.Future[h.Reply] = asyncio.get_running_loop().create_future()
        key = (request.job_id, step, request.epoch)
        self._replies[key].append(waiter)
        try:
            await self.feed(request.job_id, stimulus)
            timeout = self.restore_timeout_s if step is h.Step.RESTORE else self.rpc_timeout_s
            reply = await asyncio.wait_for(waiter, timeout)
        finally:
            waiters = self._replies.get(key, [])
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters:
                self._replies.pop(key, None)
        return pb.HandoffReply(
            ok=reply.ok, reason=reply.reason, discarded=reply.discarded, epoch=reply.recorded_epoch
        )

    async def tick(self) -> None:
        """Check deadlines and resend what must be resent, for every job."""
        for holding in list(self.store.all()):
            await self.feed(holding.job_id, h.Tick())

    async def recover(self) -> None:
        """After a start: settle what the stored holdings left unfinished."""
        for holding in list(self.store.all()):
            await self.feed(holding.job_id, h.Recovered())

    async def feed(self, job_id: str, stimulus: h.Stimulus) -> None:
        """Decide one stimulus for a job, store the holding, then carry out the actions."""
        async with self._locks[job_id]:
            decision = h.decide(self.store.load(job_id), job_id, stimulus, self.clock(), self.settings)
            if decision.holding is not None:
                self.store.save(decision.holding)
            for action in decision.actions:
                await self._carry_out(job_id, action)

    async def _carry_out(self, job_id: str, action: h.Action) -> None:
        work = self.work
        match action:
            case h.Send(step=step, peer=peer, epoch=epoch):
                self._spawn(self._send(job_id, step, peer, epoch))
            case h.StopForMove(epoch=epoch):
                self._spawn(
                    self._local(job_id, work.stop_for_move(job_id, epoch), h.CheckpointReady(epoch), epoch)
                )
            case h.SendCheckpoint(peer=peer, epoch=epoch):
                sending = work.send_checkpoint(job_id, peer, epoch)
                self._spawn(self._local(job_id, sending, h.TransferDone(epoch), epoch))
            case h.RestoreFrozen(epoch=epoch):
                self._spawn(self._restore(job_id, epoch))
            case h.ResumeHere():
                await work.resume_here(job_id)
            case h.DropLocalCopy(peer=peer):
                await work.drop_local_copy(job_id, peer)
            case h.ReleaseFrozen(epoch=epoch):
                await work.release_frozen(job_id, epoch)
            case h.DiscardIncoming(epoch=epoch):
                await work.discard_incoming(job_id, epoch)
            case h.Reply(step=step, epoch=epoch):
                for waiter in self._replies.get((job_id, step, epoch), []):
                    if not waiter.done():
                        waiter.set_result(action)
            case h.Note(text=text):
                work.note(job_id, text)
            case h.MoveFinished():
                for finished in self._moves.pop(job_id, []):
                    if not finished.done():
                        finished.set_result(action)

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, job_id: str, step: h.Step, peer: str, epoch: int) -> None:
        request = pb.HandoffRequest(job_id=job_id, epoch=epoch, step=STEP_TO_PB[step])
        if step is h.Step.PREPARE:
            request.spec_json = self.work.spec_json(job_id)
            request.hold_seconds = self.settings.hold_s
        try:
            address = self.address_of(peer)
            stub = self.channels.stub(peer, address)
            if step is h.Step.PREPARE:
                reply = await self._prepare(job_id, stub, request, peer, address)
            else:
                timeout = self.restore_timeout_s if step is h.Step.RESTORE else self.rpc_timeout_s
                reply = await stub.Handoff(request, timeout=timeout)
        except (grpc.aio.AioRpcError, KeyError, Unreachable) as e:
            if isinstance(e, grpc.aio.AioRpcError):
                error = f"{e.code().name}: {e.details()}"
            else:
                error = str(e) if isinstance(e, Unreachable) else f"unknown peer {peer}"
            await self.feed(job_id, h.StepFailed(step, epoch, error))
            return
        answer = h.StepAnswered(step, epoch, reply.ok, reply.reason, reply.discarded, reply.epoch)
        await self.feed(job_id, answer)

    async def _prepare(
        self, job_id: str, stub: pb_grpc.PeerStub, request: pb.HandoffRequest, peer: str, address: str
    ) -> pb.HandoffReply:
        """Send PREPARE, trying again with backoff for `connect_retry_s` while the target cannot be
        reached (UNAVAILABLE: it refuses connections, or the connection broke); Unreachable after.

        Sending PREPARE again is safe even if an attempt reached the target: the target answers
        the same epoch from the same source as it did (handoff._target), or refuses it as stale
        once it gave that epoch up, and the source's reckoning of the target's hold starts from
        the answer it gets, after the hold began either way.
        """
        began = time.monotonic()
        pause = CONNECT_RETRY_FIRST_S
        while True:
            try:
                reply: pb.HandoffReply = await stub.Handoff(request, timeout=self.rpc_timeout_s)
                return reply
            except grpc.aio.AioRpcError as e:
                if e.code() is not grpc.StatusCode.UNAVAILABLE:
                    raise
                waited = time.monotonic() - began
                why = (e.details() or "unavailable").rsplit(": ", 1)[-1]  # gRPC's last error, e.g. refused
                if waited + pause > self.connect_retry_s:
                    raise Unreachable(f"cannot reach {peer} at {address} for {waited:.0f}s ({why})") from e
                if pause == CONNECT_RETRY_FIRST_S:  # the first failure
                    self.work.note(
                        job_id,
                        f"PREPARE: cannot reach {peer} at {address} ({why}); "
                        f"trying again for up to {self.connect_retry_s:g}s",
                    )
                log.info("job %s: PREPARE: %s unreachable, again in %.2fs", job_id, peer, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, CONNECT_RETRY_MAX_S)

    async def _local(self, job_id: str, work: Any, success: h.Stimulus, epoch: int) -> None:
        try:
            await work
        except Exception as e:  # any failure of the daemon's work is the machine's to judge
            log.warning("move work for job %s failed: %s", job_id, e)
            await self.feed(job_id, h.MoveWorkFailed(epoch, str(e) or type(e).__name__))
            return
        await self.feed(job_id, success)

    async def _restore(self, job_id: str, epoch: int) -> None:
        try:
            await self.work.restore_frozen(job_id, epoch)
        except Exception as e:  # reported to the source as a refused RESTORE
            await self.feed(job_id, h.RestoreFinished(epoch, str(e) or type(e).__name__))
            return
        await self.feed(job_id, h.RestoreFinished(epoch))

    async def close(self) -> None:
        """Cancel the tasks in flight (their outcomes are settled by `recover` at the next start)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
