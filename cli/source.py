"""What `sing top` reads and does, behind one small interface, and its implementation over the daemon.

The app depends only on `DataSource`: `DaemonSource` is the real one (the same socket, channel
and error mapping as every `sing` command); tests of the picture plug in a fixed source with a
frozen clock. Every method blocks, so the app calls them from worker threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc

from singularity.cli import output
from singularity.cli.client import LOST_CONNECTION, Connection, rpc_error, unreachable_message
from singularity.cli.errors import EXIT_UNAVAILABLE, CliError
from singularityd.api.v1 import singularity_pb2 as pb

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


@dataclass(frozen=True)
class Snapshot:
    """Everything the overview shows, read at one moment."""

    info: pb.DaemonInfo
    jobs: Sequence[pb.Job]
    devices: Sequence[pb.Device]
    peers: pb.ListPeersResponse = field(default_factory=pb.ListPeersResponse)


@dataclass(frozen=True)
class JobAction:
    """Something a person can do to a job, and whether this daemon can do it yet."""

    name: str
    key: str
    explanation: str
    unavailable: str = ""


ACTIONS = (
    JobAction("preempt", "p", "checkpoint it and stop it; it resumes when the scheduler gives it devices"),
    JobAction("suspend", "s", "checkpoint it and stop it (or hold it if queued) until resumed"),
    JobAction("resume", "r", "put a suspended job back in the queue"),
    JobAction("checkpoint", "k", "checkpoint it and let it run on"),
    JobAction("cancel", "c", "end it: SIGTERM, then SIGKILL"),
    JobAction("resize", "z", "checkpoint it and restore it on fewer or more devices (ranks see no change)"),
    JobAction("migrate", "m", "checkpoint it here, move it to the peer and resume it there"),
)


class LogStream(Protocol):
    """A rank's log as it grows; iterating blocks for new output until the job ends or cancel()."""

    def __iter__(self) -> Iterator[bytes]: ...

    def cancel(self) -> None:
        """Stop following (from any thread); the iteration ends."""


class DataSource(Protocol):
    """The daemon as `sing top` sees it."""

    def where(self) -> str:
        """Where the data comes from, for the title."""

    def now(self) -> float:
        """The current time (a test's source freezes it)."""

    def snapshot(self, all_jobs: bool) -> Snapshot:
        """Daemon facts, jobs (ended ones too when all_jobs) and devices; CliError when unreachable."""

    def job_detail(self, job_id: int) -> pb.JobDetail:
        """One job with its checkpoints and event timeline."""

    def follow_log(self, job_id: int, rank: int) -> LogStream:
        """The rank's log from its start, following it through preemptions, restores and restarts."""

    def act(self, action: str, job_id: int, target: str = "") -> str:
        """Do one of ACTIONS to a job (migrate: to the peer named by target; resize: to the number of
        devices it names); a sentence saying what happened (CliError when refused)."""


class LogFollower:
    """A rank's log from a byte offset, reconnecting when the daemon restarts, until the job ends.

    Each chunk says where it starts in the log, so after a lost connection the follower asks for
    exactly the bytes after the last one it got: nothing is lost or repeated.
    """

    def __init__(
        self,
        socket_path: Path,
        job_id: int,
        rank: int = 0,
        *,
        follow: bool = True,
        tail: int | None = None,
        retry_seconds: float = 1.0,
        give_up_seconds: float | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.request = pb.LogsRequest(id=job_id, rank=rank, follow=follow)
        if tail is not None:
            self.request.tail = tail
        self.offset: int | None = None
        self.retry_seconds = retry_seconds
        self.give_up_seconds = give_up_seconds
        """How long the daemon may stay away before following ends with an error (None: for ever)."""
        self._cancelled = threading.Event()
        self._call: Any = None

    def cancel(self) -> None:
        """Stop following; the iteration ends (safe from any thread)."""
        self._cancelled.set()
        call = self._call
        if call is not None:
            call.cancel()

    def __iter__(self) -> Iterator[bytes]:
        self._first_contact()
        away_since: float | None = None
        while not self._cancelled.is_set():
            connection = Connection(self.socket_path)
            request = pb.LogsRequest()
            request.CopyFrom(self.request)
            if self.offset is not None:
                request.offset = self.offset
            try:
                self._call = connection.stub.StreamLogs(request)
                for chunk in self._call:
                    self.offset = chunk.offset + len(chunk.data)
                    yield chunk.data
                return
            except grpc.RpcError as error:
                if self._cancelled.is_set():
                    return
                if error.code() not in RETRYABLE:
                    raise rpc_error(error, self.socket_path) from None
                if away_since is None or any(sign in (error.details() or "") for sign in LOST_CONNECTION):
                    away_since = time.monotonic()
                self._give_up_after(away_since)
                self._cancelled.wait(self.retry_seconds)
            finally:
                self._call = None
                connection.close()

    def _give_up_after(self, away_since: float) -> None:
        """End following (CliError, exit 3) once the daemon has been away longer than allowed: it
        stopped rather than restarted."""
        if self.give_up_seconds is None or time.monotonic() - away_since < self.give_up_seconds:
            return
        raise CliError(
            f"singularityd at {self.socket_path} stopped and has not come back for "
            f"{self.give_up_seconds:g}s; stopped following job {self.request.id}",
            EXIT_UNAVAILABLE,
        )

    def _first_contact(self) -> None:
        """Fail at once when the daemon cannot be reached or has no such job (later, it is retried)."""
        connection = Connection(self.socket_path)
        try:
            connection.stub.GetJob(pb.JobRef(id=self.request.id))
        except grpc.RpcError as error:
            raise rpc_error(error, self.socket_path) from None
        finally:
            connection.close()


class DaemonSource:
    """The real daemon over its socket; reconnects with a fresh channel after it was unreachable."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self._connection: Connection | None = None
        self._lock = threading.Lock()

    def where(self) -> str:
        """The socket path."""
        return str(self.socket_path)

    def now(self) -> float:
        """Wall-clock time."""
        return time.time()

    def close(self) -> None:
        """Close the channel."""
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None

    def _stub(self) -> Any:
        """The stub of the current channel, opening one when there is none."""
        with self._lock:
            if self._connection is None:
                if not self.socket_path.exists():
                    raise CliError(unreachable_message(self.socket_path), EXIT_UNAVAILABLE)
                self._connection = Connection(self.socket_path)
            return self._connection.stub

    def _call(self, method: str, request: Any) -> Any:
        """Call one unary RPC; a CliError when it fails (and a fresh channel next time if unreachable)."""
        stub = self._stub()
        try:
            return getattr(stub, method)(request)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                self.close()
            raise rpc_error(error, self.socket_path) from None

    def snapshot(self, all_jobs: bool) -> Snapshot:
        """Daemon facts, jobs, devices and peers, in four calls."""
        info = self._call("GetDaemonInfo", pb.DaemonInfoRequest())
        jobs = self._call("ListJobs", pb.ListJobsRequest(all=all_jobs)).jobs
        devices = self._call("ListDevices", pb.ListDevicesRequest()).devices
        peers = self._call("ListPeers", pb.ListPeersRequest())
        return Snapshot(info=info, jobs=list(jobs), devices=list(devices), peers=peers)

    def job_detail(self, job_id: int) -> pb.JobDetail:
        """GetJob."""
        detail: pb.JobDetail = self._call("GetJob", pb.JobRef(id=job_id))
        return detail

    def follow_log(self, job_id: int, rank: int) -> LogFollower:
        """A follower on its own channel, so cancelling it leaves the others alone."""
        return LogFollower(self.socket_path, job_id, rank)

    def act(self, action: str, job_id: int, target: str = "") -> str:
        """Call the action's RPC and say what happened."""
        ref = pb.JobRef(id=job_id)
        if action == "migrate":
            return self._migrate(job_id, target)
        if action == "resize":
            job = self._call("Resize", pb.ResizeRequest(id=job_id, gpus=int(target)))
            return f"job {job_id}: resizing to {target} device{'s' if target != '1' else ''} ({job.state})"
        if action == "checkpoint":
            return output.checkpoint_text(self._call("Checkpoint", ref))
        if action == "cancel":
            result = self._call("Cancel", pb.CancelRequest(ids=[job_id])).results[0]
            if not result.ok:
                raise CliError(result.error)
            return f"job {job_id}: cancel requested ({result.state})"
        methods = {"preempt": "Preempt", "suspend": "Suspend", "resume": "Resume"}
        if action not in methods:
            known = next((a for a in ACTIONS if a.name == action), None)
            raise CliError(known.unavailable if known and known.unavailable else f"unknown action {action!r}")
        job = self._call(methods[action], ref)
        return f"job {job_id}: {job.state}" + (f" ({job.reason})" if job.reason else "")

    def _migrate(self, job_id: int, peer: str) -> str:
        """Follow the move to its end; what came of it."""
        stub = self._stub()
        try:
            ended = [m for m in stub.Migrate(pb.MigrateRequest(id=job_id, to=peer)) if m.done]
        except grpc.RpcError as error:
            raise rpc_error(error, self.socket_path) from None
        if not ended or not ended[-1].ok:
            raise CliError(ended[-1].detail if ended else "the move ended without a result")
        return f"job {job_id}: moved to {ended[-1].peer}"
