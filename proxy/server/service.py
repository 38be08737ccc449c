"""The proxy server of one device: its sessions and the job connections that feed them.

`Server` knows the device, admits job processes (a hello names the job; the kernel names
the uid), keeps one session per (job id, rank, logical device), and reads each job connection in its own
thread into the session's queue, which the session's own thread runs (runner.py). The
collectives of the job's processes run here and, over the job's links, with the servers of its
other devices (collectives.py). The daemon's requests arrive on a separate control channel
(see control.py); both reach the same Server.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from typing import Any

import torch

from singularity.proxy.bootstrap._singularity_proxy import protocol
from singularity.proxy.bootstrap._singularity_proxy.protocol import ProtocolError

from .collective_kinds import KINDS
from .collectives import Collectives
from .dedup import Dedup
from .device_memory import DeviceMemory
from .executor import Executor
from .pace import GRACE, Pace
from .runner import Runner, Work
from .session import UNKNOWN_DEVICE, Connection, Session, SessionKey, exception_info
from .squash import Squash


def _refusal(kind: type[BaseException], message: str) -> list[str]:
    """The body of an ERROR message raising `kind(message)` in the job."""
    return [kind.__module__, kind.__qualname__, message]


class Server:
    """A proxy server for one device: sessions of job processes and the executor running their work."""

    def __init__(
        self,
        device_index: int,
        memory_bytes: int,
        cuda_device: int | None,
        name: str | None = None,
        job_id: str | None = None,
        job_uid: int | None = None,
        daemon_uid: int | None = None,
        splice_lean: bool = True,
        turn_grace: float = GRACE,
    ) -> None:
        self.index = device_index
        self.job_id = job_id
        """The one job this server serves (None: any, for tests and tools that run a server by hand)."""
        self.job_uid = job_uid
        """The uid whose processes may open its sessions, besides root (None: the server's own)."""
        self.daemon_uid = os.getuid() if daemon_uid is None else daemon_uid
        """The uid allowed to reattach a saved session to a restored process (the daemon's)."""
        if cuda_device is None:
            self.device = torch.device("cpu")
            name, major, minor, processors, kind = name or "Singularity Virtual Device", 8, 0, 1, "virtual"
        else:
            self.device = torch.device("cuda", cuda_device)
            properties = torch.cuda.get_device_properties(self.device)
            name = name or properties.name
            major, minor, processors = properties.major, properties.minor, properties.multi_processor_count
            kind = "cuda"
        self.info: dict[str, Any] = dict(
            zip(
                protocol.DEVICE_INFO_KEYS,
                (name, memory_bytes, major, minor, processors, kind, device_index),
                strict=True,
            )
        )
        # torch leaves the index checks of sparse tensors off by default
        torch.sparse.check_sparse_tensor_invariants.enable()  # type: ignore[no-untyped-call]
        self.memory: DeviceMemory[Session] = DeviceMemory(device_index, memory_bytes)
        self.executor = Executor(self.device, self.memory)
        self.collectives = Collectives(device_index, self.device, self.executor.lock, KINDS)
        self.dedup = Dedup(self.memory, self.executor.lock, self.job_sessions)
        """Storages identical across the ranks of a job here, kept once (replica splicing)."""
        self.collectives.dedup = self.dedup
        self.squash = Squash(self.memory, self.dedup, self.job_sessions)
        """Operations of a job's ranks here run once (squash.py)."""
        self.executor.squash = self.squash
        self.collectives.squash = self.squash
        self.pace = Pace(grace=turn_grace, enabled=splice_lean)
        """The turns spliced ranks of a job take on the device (pace.py)."""
        self.sessions: dict[SessionKey, Session] = {}
        self.by_job: dict[str, list[Session]] = {}
        """Job id -> its sessions by rank, worked out once after sessions came or went
        (`job_sessions` is asked at every spliced operation and collective)."""
        self.runners: dict[SessionKey, Runner] = {}
        """The queue and thread of each session."""
        self.served_jobs: set[str] = set()
        """Jobs that ever had a session here: one that has none now ended; another never came (its
        process may use other devices alone), and its device state here is nothing."""
        self.state_lock = threading.RLock()
        """Held while sessions are added, removed or looked up."""

    # -- sessions ---------------------------------------------------------------------------------
    def add_session(
        self, session: Session, saved_queue: list[Any] | None = None, groups: dict[str, Any] | None = None
    ) -> Runner:
        """Hold a new session and start its thread (a restored one holds its saved work until resumed)."""
        key = session.key
        with self.state_lock:
            runner = Runner(session, self.executor, self.collectives, saved_queue, groups, self.pace)
            self.sessions[key] = session
            self.runners[key] = runner
            self.served_jobs.add(session.job_id)
            self.by_job.clear()
            self.squash.sessions_changed()
            with self.collectives.cond:
                self.pace.join(runner)
        return runner

    def drop(self, session: Session) -> None:
        """Stop a session's thread, free everything it holds and forget it."""
        self._dispose(session, self._detach(session))

    def _detach(self, session: Session) -> Runner | None:
        """Forget a session (its runner, to be stopped, if it was still known)."""
        key = session.key
        with self.state_lock:
            runner = self.runners.get(key) if self.sessions.get(key) is session else None
            if runner is not None:
                del self.runners[key]
                del self.sessions[key]
                self.by_job.clear()
                self.squash.sessions_changed()
        if runner is not None:
            with self.collectives.cond:
                self.pace.leave(runner)
        return runner

    def _dispose(self, session: Session, runner: Runner | None) -> None:
        """Stop a forgotten session's thread and free what it holds, on the device's lock: the
        frees change storages other sessions share and the device's counts, so they never run
        beside an operation (call without the state lock: the device's lock comes first). The
        memory itself goes on a thread of its own, so that whoever waits for the release does not
        wait for the kernel to take back gigabytes."""
        if runner is not None:
            runner.stop()
        with self.executor.lock:
            held = session.free_all()
            if not self.job_sessions(session.job_id):
                self.squash.drop_job(session.job_id)  # what it kept for the job's sessions goes too
        threading.Thread(target=held.clear, name="free-memory", daemon=True).start()

    def job_runners(self, job_id: str) -> list[Runner]:
        """The runners of a job's sessions, by rank."""
        with self.state_lock:
            found = (r for (job, *_), r in self.runners.items() if job == job_id)
            return sorted(found, key=lambda r: (r.session.rank, r.session.index, r.session.process))

    def wait_idle(self, job_id: str, timeout: float) -> bool:
        """Wait until nothing of the job's sessions can run here (see runner.Runner.idle)."""
        return bool(self.collectives.settle(self.job_runners(job_id), timeout)["idle"])

    def settle(self, job_id: str, timeout: float) -> dict[str, Any]:
        """Wait until the job is quiet here; what the daemon compares across the job's servers."""
        state = self.collectives.settle(self.job_runners(job_id), timeout)
        drained = all(
            s.connection is None or s.connection.unread_bytes() == 0 for s in self.job_sessions(job_id)
        )
        state["idle"] = state["idle"] and drained
        return state

    def job_sessions(self, job_id: str) -> list[Session]:
        """The sessions of a job, by rank."""
        with self.state_lock:
            found = self.by_job.get(job_id)
            if found is None:
                of_job = (s for (job, *_), s in self.sessions.items() if job == job_id)
                found = self.by_job[job_id] = sorted(of_job, key=lambda s: (s.rank, s.index, s.process))
            return list(found)

    def job_gone(self, job_id: str) -> bool:
        """Whether the job had sessions here and has none left (its processes ended)."""
        return job_id in self.served_jobs and not self.job_sessions(job_id)

    def admission_problem(self, job_id: str, uid: int) -> str:
        """Why a process of this uid may not open a session for this job ('' when it may).

        A server the daemon starts serves one job and runs as that job's user: only processes of
        that uid (and root, the daemon reconnecting restored processes) may open sessions, and
        only for that job. The kernel names the uid (SO_PEERCRED); the socket itself is the
        user's alone, so this is a second wall.
        """
        if self.job_id is None:
            return ""  # a server started by hand serves whoever can open its socket
        if job_id != self.job_id:
            return f"proxy: this device server serves job {self.job_id}, not {job_id!r}"
        allowed = os.getuid() if self.job_uid is None else self.job_uid
        if uid not in (0, allowed):
            return f"proxy: uid {uid} may not use the devices of job {job_id}"
        return ""

    def _open_session(self, connection: Connection, uid: int, hello: protocol.Frame) -> Session | None:
        """The session a hello asks for, attached to the connection; None after refusing it."""
        body = hello.decode() if hello.kind == protocol.HELLO else None
        if type(body) is list and len(body) == 4:
            body = [*body, 0]  # a client from before processes were told apart
        if (
            type(body) is not list
            or len(body) != 5
            or type(body[0]) is not str
            or type(body[1]) is not int
            or type(body[2]) is not int
            or type(body[3]) is not bool
            or type(body[4]) is not int
        ):
            connection.send(
                protocol.ERROR, _refusal(PermissionError, "proxy: the first message must be a hello")
            )
            return None
        job_id, rank, index, resume, process = body
        key = (job_id, rank, index, process)
        replaced: tuple[Session, Runner | None] | None = None
        with self.state_lock:
            existing = self.sessions.get(key)
            if resume and existing is None:
                existing = self.sessions.get((job_id, rank, UNKNOWN_DEVICE, process))
            if resume:
                if existing is None or uid not in (0, self.daemon_uid):
                    connection.send(
                        protocol.ERROR, _refusal(RuntimeError, f"proxy: no session to resume for {key}")
                    )
                    return None
                session = existing
            else:
                refusal = self.admission_problem(job_id, uid)
                if not refusal and existing is not None and existing.uid != uid and uid != 0:
                    refusal = f"proxy: session {key} belongs to another user"
                if not refusal and existing is not None and existing.connection is not None:
                    refusal = f"proxy: session {key} is in use by another connection"
                if refusal:
                    connection.send(protocol.ERROR, _refusal(PermissionError, refusal))
                    return None
                if existing is not None:
                    replaced = (existing, self._detach(existing))
                session = Session(job_id, rank, uid, self.memory, index, process)
                self.add_session(session)
            session.connection = connection
        if replaced is not None:
            self._dispose(*replaced)
        return session

    # -- job connections --------------------------------------------------------------------------
    def serve_job(self, sock: socket.socket) -> None:
        """Read one job process's connection into its session's queue until it closes."""
        connection = Connection(sock)
        credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", credentials)
        session: Session | None = None
        try:
            session = self._open_session(
                connection, uid, protocol.recv_frame(sock, protocol.JOB_FRAME_LIMITS)
            )
            if session is None:
                return
            connection.send(protocol.WELCOME, self.info)
            runner = self.runners[session.key]
            while True:
                self._take(session, runner, protocol.recv_frame(sock, protocol.JOB_FRAME_LIMITS))
        except ProtocolError as e:  # the framing is broken: nothing after it can be trusted
            with contextlib.suppress(OSError):
                connection.send(protocol.GOODBYE, exception_info(e))
        except (ConnectionError, OSError, EOFError, KeyError):
            pass
        finally:
            with contextlib.suppress(OSError):
                sock.close()
            if session is not None:
                self._closed(session, connection)

    def _closed(self, session: Session, connection: Connection) -> None:
        """A job connection ended: the session of a process that ended unparked retires."""
        session.parked_event.set()  # a quiesce waiting on this process must not wait forever
        with self.state_lock:
            if session.connection is not connection:
                return
            session.connection = None
            if session.parked:
                return  # a checkpoint takes the session; resuming the job retires it
        self.retire(session)

    def retire(self, session: Session) -> None:
        """The session's process has ended: run what it sent (a GPU finishes what a process
        launched before it ended), then forget the session, and its collectives' other members
        learn it (what waits for it fails). A checkpoint that parks the job meanwhile keeps the
        session, with what it has left to run; the job's resume retires it again."""
        with self.state_lock:
            if session.retiring:
                return
            session.retiring = True
            runner = self.runners.get(session.key)
        if runner is not None:
            runner.finish()
        with self.state_lock:
            session.retiring = False
            if session.park_asked:
                return
        if runner is not None:
            self.collectives.rank_gone(runner)
        self.drop(session)

    def _take(self, session: Session, runner: Runner, frame: protocol.Frame) -> None:
        """Queue one message from the job; what cannot be taken becomes an error in the program."""
        if frame.kind in (protocol.BATCH, protocol.REQUEST):
            answer = frame.kind == protocol.REQUEST
            try:
                body = frame.decode()
                if answer and (type(body) is not list or len(body) != 2):
                    raise ProtocolError("a request message is [operations, request]")
                if not answer and (type(body) is not list or len(body) != 1):
                    raise ProtocolError("a batch message is [operations]")
                if type(body[0]) is not list:
                    raise ProtocolError("the operations of a batch must be a list")
                runner.put(Work(body[0], body[1] if answer else None, frame.buffers, answer=answer))
            except ProtocolError as e:
                runner.put(Work([], None, [], answer=answer, failure=e))
            return
        if frame.kind == protocol.PARKED:
            if not session.park_asked:
                runner.put(Work([], None, [], answer=False, failure=ProtocolError("PARKED without a PARK")))
                return
            body = frame.decode()
            with self.collectives.cond:
                session.waiting = type(body) is list and body == [True]
                session.parked_at = time.monotonic()
                session.parked = True
                session.parked_event.set()
                self.collectives.events += 1
                self.collectives.cond.notify_all()
            return
        runner.put(
            Work([], None, [], answer=False, failure=ProtocolError(f"unknown message kind {frame.kind}"))
        )
