"""Transfers over the peer service: the sender's loop (with resume) and the receiving handler.

The sender opens the transfer (BeginTransfer says which chunks the receiver holds), streams the
missing chunks (SendChunks, read and hashed ahead on threads) and asks for the verdict
(FinishTransfer with the digest of every chunk). When the link breaks it opens the transfer
again after a pause: the receiver answers with what arrived, and only the rest is sent.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import grpc.aio

from singularityd.federation.peer import DataLoss, Refused
from singularityd.federation.transfer import (
    ChunkKey,
    Destination,
    Entry,
    Progress,
    ProgressCallback,
    Source,
    TransferError,
    missing,
)
from singularityd.federation.v1 import peer_pb2 as pb
from singularityd.federation.v1 import peer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

READ_AHEAD = 4
PUTS_IN_FLIGHT = 2
SETTLE_WAIT_S = 60.0
"""The longest a receiver waits for the work a complete transfer starts (see Received) before it
answers: a pre-copy's sender stops the job only then, so that work is not part of the downtime."""
TRANSFER_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")
RETRIABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
     grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
)  # fmt: skip


def entries_to_pb(entries: list[Entry]) -> list[pb.FileEntry]:
    """Entries as wire messages."""
    return [pb.FileEntry(path=e.path, size=e.size, mode=e.mode, link=e.link) for e in entries]


def entries_from_pb(messages: list[pb.FileEntry]) -> list[Entry]:
    """Wire messages as entries."""
    return [Entry(m.path, m.size, m.mode, m.link) for m in messages]


def held_from_pb(state: pb.TransferState) -> dict[ChunkKey, bytes]:
    """The chunks a receiver says it holds, with their digests."""
    return {(c.file, c.index): c.sha256 for c in state.have}


@dataclass
class Sending:
    """One directory on its way to one peer: what to send, and how to report progress."""

    stub: pb_grpc.PeerStub
    source: Source
    transfer_id: str
    job_id: str
    epoch: int
    progress: ProgressCallback | None = None
    sent: int = 0
    finish_s: float = 0.0
    """Seconds the sender waited for the receiver's verdict (FinishTransfer), all attempts."""
    answered_at: float | None = None
    """When the receiver last answered (opened the transfer, or took a chunk), by time.monotonic."""

    def _report(self, phase: str, moved: int) -> None:
        if self.progress is not None:
            self.progress(Progress(phase, moved, self.source.total, self.sent))

    async def seed(self, *, call_timeout_s: float = 30.0) -> None:
        """Open the transfer and send what is missing, without finishing it: a later transfer
        under the same id sends only what differs (see `Destination`). gRPC errors propagate."""
        request = pb.BeginTransferRequest(
            transfer_id=self.transfer_id,
            job_id=self.job_id,
            epoch=self.epoch,
            chunk_size=self.source.chunk_size,
            files=entries_to_pb(self.source.entries),
        )
        state = await self.stub.BeginTransfer(request, timeout=call_timeout_s)
        self.answered_at = time.monotonic()
        self._report("comparing", 0)
        todo = await asyncio.to_thread(missing, self.source, held_from_pb(state))
        moved = self.source.total - sum(self.source.chunks[key][1] for key in todo)
        self._report("sending", moved)
        if todo:
            await self.stub.SendChunks(self._chunks(todo, moved))

    async def seed_once(self) -> None:
        """`seed` once; a gRPC failure raises TransferError (the later transfer sends it all)."""
        try:
            await self.seed()
        except grpc.aio.AioRpcError as e:
            raise TransferError(f"transfer {self.transfer_id}: {e.code().name}: {e.details()}") from e

    async def attempt(self, *, reread: bool = False, call_timeout_s: float = 30.0) -> None:
        """One try: open, send what is missing, finish. gRPC errors propagate; a bad verdict raises."""
        await self.seed(call_timeout_s=call_timeout_s)
        self._report("verifying", self.source.total)
        manifest = await asyncio.to_thread(self.source.manifest)
        finish = pb.FinishTransferRequest(
            transfer_id=self.transfer_id,
            manifest=[pb.ChunkRef(file=f, index=i, sha256=d) for (f, i), d in manifest.items()],
            reread=reread,
        )
        asked = time.monotonic()
        try:
            verdict = await self.stub.FinishTransfer(finish, timeout=call_timeout_s)
        finally:
            self.finish_s += time.monotonic() - asked
        if not verdict.ok:
            raise TransferError("the receiver rejected the transfer: " + "; ".join(verdict.problems[:3]))
        self._report("done", self.source.total)

    async def _chunks(self, todo: list[ChunkKey], moved: int) -> AsyncIterator[pb.Chunk]:
        loop = asyncio.get_running_loop()
        keys = iter(todo)
        pending: deque[tuple[ChunkKey, asyncio.Future[tuple[bytes, bytes]]]] = deque()

        def read_next() -> None:
            key = next(keys, None)
            if key is not None:
                pending.append((key, loop.run_in_executor(None, self.source.read, key)))

        for _ in range(READ_AHEAD):
            read_next()
        while pending:
            key, future = pending.popleft()
            chunk_digest, data = await future
            read_next()
            self.answered_at = time.monotonic()  # the stream took the chunk before
            self.sent += len(data)
            moved += len(data)
            self._report("sending", moved)
            yield pb.Chunk(
                transfer_id=self.transfer_id, file=key[0], index=key[1], sha256=chunk_digest, data=data
            )

    async def run(
        self,
        *,
        attempts: int = 10,
        pause_s: float = 1.0,
        reread: bool = False,
        patience_s: float | None = None,
    ) -> None:
        """Attempt until it works, resuming after broken links; refusals and bad verdicts raise at
        once, and so does a receiver that has not answered for `patience_s` (gone, not blipped)."""
        began = time.monotonic()
        for attempt in range(1, attempts + 1):
            try:
                await self.attempt(reread=reread)
                return
            except grpc.aio.AioRpcError as e:
                if e.code() not in RETRIABLE or attempt == attempts:
                    raise TransferError(
                        f"transfer {self.transfer_id} failed: {e.code().name}: {e.details()}"
                    ) from e
                silent_s = time.monotonic() - max(began, self.answered_at or began)
                if patience_s is not None and silent_s >= patience_s:
                    raise TransferError(
                        f"transfer {self.transfer_id} failed: the receiver has not answered for "
                        f"{silent_s:.0f}s ({e.code().name}: {e.details()})"
                    ) from e
                log.info("transfer %s interrupted (%s); resuming", self.transfer_id, e.code().name)
                self._report("waiting", 0)
                await asyncio.sleep(pause_s)


Authorize = Callable[[str, str, int], Path]
"""(peer node, job id, epoch) -> the directory to receive into; raises Refused when not expected."""
Received = Callable[[str, int, Path], Awaitable[object] | None]
"""(job id, epoch, directory): every chunk a transfer's sender opened it with has arrived and been
checked (before its FinishTransfer, which a pre-copy never sends); what it returns (the work the
arrival starts here: a preload) is waited for, at most SETTLE_WAIT_S, before the sender is answered."""


@dataclass
class _Open:
    node: str
    job_id: str
    epoch: int
    destination: Destination
    lock: threading.Lock = field(default_factory=threading.Lock)


class Receivers:
    """The receiving side for every transfer to this daemon (a TransferHandler)."""

    def __init__(self, authorize: Authorize, received: Received | None = None) -> None:
        self.authorize = authorize
        self.received = received
        self.open: dict[str, _Open] = {}
        self.digests: dict[tuple[str, int], dict[str, str]] = {}
        """Per (job, epoch) whose transfer finished: the sha256 of each file received, by path,
        hashed as it was written (see transfer.FileHashes); taken with `take_digests`."""

    async def begin(self, node: str, request: pb.BeginTransferRequest) -> pb.TransferState:
        """Open (or reopen) a transfer the hand-off expects; answer with the chunks already here."""
        if TRANSFER_ID_RE.fullmatch(request.transfer_id) is None:
            raise Refused(f"bad transfer id {request.transfer_id!r}")
        directory = self.authorize(node, request.job_id, request.epoch)
        entries = entries_from_pb(list(request.files))
        previous = self.open.get(request.transfer_id)
        if previous is not None and self._resumes(previous, node, request, entries):
            return self._state(previous.destination)  # the sender resumes: keep what it sent
        hashes = None  # the hashes of an earlier transfer of the same move (the pre-copy) go on
        if previous is not None and self._same_move(previous, node, request):
            hashes = previous.destination.hashes
        try:
            destination = await asyncio.to_thread(Destination, directory, entries, request.chunk_size, hashes)
        except (TransferError, OSError) as e:
            raise Refused(f"cannot receive transfer {request.transfer_id}: {e}") from e
        if previous is not None:
            with previous.lock:
                previous.destination.close()
        self.open[request.transfer_id] = _Open(node, request.job_id, request.epoch, destination)
        return self._state(destination)

    async def receive(self, node: str, chunks: AsyncIterator[pb.Chunk]) -> pb.TransferState:
        """Check and store chunks as they come (a few at once), then write them to disk; the reply
        is what is held afterwards."""
        current: _Open | None = None
        in_flight: deque[asyncio.Future[None]] = deque()
        try:
            async for chunk in chunks:
                current = self._find(node, chunk.transfer_id)
                key = (chunk.file, chunk.index)
                in_flight.append(
                    asyncio.ensure_future(
                        asyncio.to_thread(self._put, current, key, chunk.sha256, chunk.data)
                    )
                )
                if len(in_flight) >= PUTS_IN_FLIGHT:
                    await in_flight.popleft()
            while in_flight:
                await in_flight.popleft()
            if current is not None:
                await asyncio.to_thread(self._flush, current)
                if self.received is not None and current.destination.complete:
                    settling = self.received(current.job_id, current.epoch, current.destination.root)
                    if settling is not None:  # its outcome is the arrival's to report
                        await asyncio.wait([asyncio.ensure_future(settling)], timeout=SETTLE_WAIT_S)
        except TransferError as e:
            raise DataLoss(str(e)) from e
        finally:
            for future in in_flight:
                future.cancel()
        return self._state(current.destination) if current else pb.TransferState()

    @staticmethod
    def _put(current: _Open, key: ChunkKey, chunk_digest: bytes, data: bytes) -> None:
        current.destination.verify(key, chunk_digest, data)
        with current.lock:
            current.destination.write(key, chunk_digest, data)

    @staticmethod
    def _flush(current: _Open) -> None:
        with current.lock:
            current.destination.flush()

    async def finish(self, node: str, request: pb.FinishTransferRequest) -> pb.TransferVerdict:
        """Check the transfer against the sender's manifest; on success it is complete and closed."""
        current = self._find(node, request.transfer_id)
        self.authorize(node, current.job_id, current.epoch)
        manifest = {(c.file, c.index): c.sha256 for c in request.manifest}

        def check() -> list[str]:
            with current.lock:
                return current.destination.finish(manifest, reread=request.reread)

        problems = await asyncio.to_thread(check)
        if not problems:
            del self.open[request.transfer_id]
            self.digests[(current.job_id, current.epoch)] = current.destination.file_digests
            if current.destination.reread_bytes:
                log.info(
                    "transfer %s: %d bytes read back to hash their files (out of order, changed, or "
                    "from before a restart)",
                    request.transfer_id,
                    current.destination.reread_bytes,
                )
        return pb.TransferVerdict(ok=not problems, problems=problems)

    def take_digests(self, job_id: str, epoch: int) -> dict[str, str]:
        """The sha256 of each file of the finished transfer of (job, epoch), by path (empty when
        not known here: a restarted daemon); forgotten once taken."""
        return self.digests.pop((job_id, epoch), {})

    def cancel(self, job_id: str, epoch: int | None = None) -> None:
        """Stop receiving for a job (one epoch, or all): its chunks are refused from now on."""
        for transfer_id, current in list(self.open.items()):
            if current.job_id == job_id and (epoch is None or current.epoch == epoch):
                with current.lock:
                    current.destination.close()
                del self.open[transfer_id]
        for finished in [key for key in self.digests if key[0] == job_id and epoch in (None, key[1])]:
            del self.digests[finished]

    @staticmethod
    def _same_move(previous: _Open, node: str, request: pb.BeginTransferRequest) -> bool:
        """Whether a BeginTransfer comes from the same node for the same job and epoch."""
        return (previous.node, previous.job_id, previous.epoch) == (node, request.job_id, request.epoch)

    @classmethod
    def _resumes(
        cls, previous: _Open, node: str, request: pb.BeginTransferRequest, entries: list[Entry]
    ) -> bool:
        """Whether a BeginTransfer reopens the same transfer from the same node."""
        same = cls._same_move(previous, node, request)
        return same and previous.destination.matches(entries, request.chunk_size)

    def _find(self, node: str, transfer_id: str) -> _Open:
        current = self.open.get(transfer_id)
        if current is None or current.node != node:
            raise Refused(f"no open transfer {transfer_id!r} from {node}")
        return current

    @staticmethod
    def _state(destination: Destination) -> pb.TransferState:
        have = [pb.ChunkRef(file=f, index=i, sha256=d) for (f, i), d in destination.held.items()]
        return pb.TransferState(have=have, bytes_held=destination.bytes_held)
