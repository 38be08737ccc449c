"""The proxy server of one device: its sessions and the job connections that feed them.

`Server` knows the device, admits job processes (a hello names the job; the kernel names
the uid), keeps one session per (job id, rank), and serves each job connection in its own
thread through the executor. The daemon's requests arrive on a separate control channel
(see control.py); both reach the same Server.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from typing import Any

import torch

from singularity.proxy.bootstrap._singularity_proxy import protocol
from singularity.proxy.bootstrap._singularity_proxy.protocol import ProtocolError

from .executor import Executor
from .session import Connection, DeviceMemory, Session, exception_info


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
        self.memory = DeviceMemory(device_index, memory_bytes)
        self.executor = Executor(self.device, self.memory)
        self.sessions: dict[tuple[str, int], Session] = {}
        self.state_lock = threading.RLock()
        """Held while sessions are added, removed or looked up."""

    # -- sessions ---------------------------------------------------------------------------------
    def drop(self, session: Session) -> None:
        """Free everything a session holds and forget it."""
        with self.state_lock:
            session.free_all()
            if self.sessions.get((session.job_id, session.rank)) is session:
                del self.sessions[(session.job_id, session.rank)]

    def job_sessions(self, job_id: str) -> list[Session]:
        """The sessions of a job, by rank."""
        with self.state_lock:
            found = (s for (job, _rank), s in self.sessions.items() if job == job_id)
            return sorted(found, key=lambda s: s.rank)

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
        if (
            type(body) is not list
            or len(body) != 4
            or type(body[0]) is not str
            or type(body[1]) is not int
            or type(body[3]) is not bool
        ):
            connection.send(
                protocol.ERROR, _refusal(PermissionError, "proxy: the first message must be a hello")
            )
            return None
        job_id, rank, _index, resume = body
        key = (job_id, rank)
        with self.state_lock:
            existing = self.sessions.get(key)
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
                    refusal = f"proxy: session {key} is in use by another process"
                if refusal:
                    connection.send(protocol.ERROR, _refusal(PermissionError, refusal))
                    return None
                if existing is not None:
                    self.drop(existing)
                session = Session(job_id, rank, uid, self.memory)
                self.sessions[key] = session
            session.connection = connection
        return session

    # -- job connections --------------------------------------------------------------------------
    def serve_job(self, sock: socket.socket) -> None:
        """Serve one job process's connection until it closes (or breaks the framing)."""
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
            torch.set_grad_enabled(True)  # some kernels (mkldnn RNN) keep state only then
            while True:
                self._take(session, connection, protocol.recv_frame(sock, protocol.JOB_FRAME_LIMITS))
        except ProtocolError as e:  # the framing is broken: nothing after it can be trusted
            with contextlib.suppress(OSError):
                connection.send(protocol.GOODBYE, exception_info(e))
        except (ConnectionError, OSError, EOFError):
            pass
        finally:
            with contextlib.suppress(OSError):
                sock.close()
            if session is not None:
                session.parked_event.set()  # a quiesce waiting on this process must not wait forever
                with self.state_lock:
                    if session.connection is connection:
                        session.connection = None
                        if not session.parked:
                            self.drop(session)

    def _take(self, session: Session, connection: Connection, frame: protocol.Frame) -> None:
        """Act on one message from the job; what it cannot take becomes an error in the program."""
        if frame.kind == protocol.REQUEST:
            try:
                body = frame.decode()
                if type(body) is not list or len(body) != 2:
                    raise ProtocolError("a request message is [operations, request]")
                value = self.executor.run_batch(session, body[0], body[1], frame.buffers)
                connection.send(protocol.REPLY, value)  # encodes fully before writing anything
            except Exception as e:
                connection.send(protocol.ERROR, exception_info(e))
            return
        try:
            if frame.kind == protocol.BATCH:
                body = frame.decode()
                if type(body) is not list or len(body) != 1:
                    raise ProtocolError("a batch message is [operations]")
                self.executor.run_batch(session, body[0], None, frame.buffers)
            elif frame.kind == protocol.PARKED:
                if not session.park_asked:
                    raise ProtocolError("PARKED without a PARK")
                body = frame.decode()
                session.waiting = type(body) is list and body == [True]
                session.parked = True
                session.parked_event.set()
            else:
                raise ProtocolError(f"unknown message kind {frame.kind}")
        except Exception as e:
            session.fail(e)
