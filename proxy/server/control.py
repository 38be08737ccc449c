"""The server's side of the daemon's control channel: quiesce, save, release, load, resume, status.

Requests come from the daemon (proxy/control.py is its client) on a socket no job can open.
Each names a job; the handler parks, saves, frees, recreates or resumes that job's sessions
in the Server it was given, and answers with the result or the failure.
"""

from __future__ import annotations

import contextlib
import socket
import time
from pathlib import Path
from typing import Any

import torch

from singularity.proxy.bootstrap._singularity_proxy import protocol
from singularity.proxy.bootstrap._singularity_proxy.protocol import ProtocolError

from .service import Server
from .session import Session


class ControlHandler:
    """Carries out the daemon's requests on one Server."""

    def __init__(self, server: Server) -> None:
        self.server = server

    def quiesce(self, job_id: str, timeout: float) -> list[int]:
        """Park every connected process of the job at an operation boundary; the ranks parked."""
        deadline = time.monotonic() + timeout
        sessions = self.server.job_sessions(job_id)
        for session in sessions:
            if session.connection is not None and not session.parked:
                session.parked_event.clear()
                session.park_asked = True
                session.connection.send(protocol.PARK)
        parked = []
        for session in sessions:
            connection = session.connection
            if connection is None:
                session.parked = True
                parked.append(session.rank)
                continue
            arrived = session.parked_event.wait(max(0.0, deadline - time.monotonic()))
            if not arrived and not session.parked:
                raise TimeoutError(f"job {job_id} rank {session.rank} did not park in {timeout}s")
            if not session.parked:
                continue  # the process ended meanwhile
            while connection.unread_bytes() > 0:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {job_id} rank {session.rank}: channel not drained")
                time.sleep(0.001)
            parked.append(session.rank)
        return parked

    def save(self, job_id: str, directory: str) -> dict[str, int]:
        """Write the live tensors of a quiesced job, one file per rank."""
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        live = written = 0
        sessions = self.server.job_sessions(job_id)
        if not sessions:
            raise KeyError(f"proxy: no job {job_id!r} on device {self.server.index}")
        with self.server.executor.lock:
            for session in sessions:
                if not session.parked:
                    raise RuntimeError(f"proxy: job {job_id} rank {session.rank} is not quiesced")
                state = {
                    "job_id": session.job_id,
                    "rank": session.rank,
                    "uid": session.uid,
                    "tensors": session.tensors,
                    "ops": session.operator_names,
                    "plans": session.plan_wire,
                    "peak": session.peak_bytes,
                    "pending_error": session.pending_error,
                }
                path = folder / f"rank{session.rank}.pt"
                torch.save(state, path)
                live += session.held_bytes
                written += path.stat().st_size
        return {"live_bytes": live, "file_bytes": written, "ranks": len(sessions)}

    def release(self, job_id: str) -> int:
        """Free everything the job holds here, closing its connections; the bytes freed."""
        freed = 0
        for session in self.server.job_sessions(job_id):
            freed += session.held_bytes
            connection = session.connection
            session.connection = None
            if connection is not None:
                with contextlib.suppress(OSError):
                    connection.sock.shutdown(socket.SHUT_RDWR)
            self.server.drop(session)
        return freed

    def load(self, job_id: str, directory: str) -> dict[str, int]:
        """Recreate a saved job's tensors here, parked until resume."""
        files = sorted(Path(directory).glob("rank*.pt"))
        if not files:
            raise FileNotFoundError(f"proxy: no saved ranks in {directory}")
        loaded = 0
        server = self.server
        with server.executor.lock:
            for file in files:
                state = torch.load(file, map_location=server.device, weights_only=True)
                key = (job_id, int(state["rank"]))
                with server.state_lock:
                    if key in server.sessions:
                        raise RuntimeError(f"proxy: job {job_id} rank {key[1]} already here")
                    session = Session(job_id, key[1], int(state["uid"]), server.memory)
                    session.parked = True
                    session.parked_event.set()
                    for op_id, (namespace, name, overload) in state["ops"].items():
                        session.define(op_id, namespace, name, overload)
                    session.restore_plans(state.get("plans", {}), server.device)
                    handles: list[int] = []
                    for handle, tensor in state["tensors"].items():
                        session.add(int(handle), tensor)
                        handles.append(int(handle))
                    session.peak_bytes = max(session.held_bytes, int(state["peak"]))
                    session.pending_error = state["pending_error"]
                    server.sessions[key] = session
                    try:
                        session.check_capacity(handles, session.held_bytes)
                    except torch.OutOfMemoryError:
                        server.drop(session)
                        raise
                    loaded += session.held_bytes
        return {"live_bytes": loaded, "ranks": len(files)}

    def resume(self, job_id: str) -> list[int]:
        """Let the job's parked processes go on; the ranks resumed."""
        ranks = []
        for session in self.server.job_sessions(job_id):
            if session.parked and session.connection is not None:
                session.parked = False
                session.park_asked = False
                session.parked_event.clear()
                session.connection.send(protocol.RESUME)
                ranks.append(session.rank)
        return ranks

    def status(self) -> dict[str, Any]:
        """Capacity, bytes in use and the sessions present on this device."""
        server = self.server
        with server.state_lock:
            return {
                "index": server.index,
                "capacity": server.memory.capacity,
                "allocated": server.memory.used,
                "jobs": {
                    f"{job}/{rank}": {
                        "bytes": session.held_bytes,
                        "parked": session.parked,
                        "waiting": session.waiting,
                        "connected": session.connection is not None,
                    }
                    for (job, rank), session in server.sessions.items()
                },
            }

    def handle(self, name: str, args: tuple[Any, ...]) -> Any:
        """Carry out one control request; its result."""
        if name == "quiesce":
            return self.quiesce(str(args[0]), float(args[1]))
        if name == "save":
            return self.save(str(args[0]), str(args[1]))
        if name == "release":
            return self.release(str(args[0]))
        if name == "load":
            return self.load(str(args[0]), str(args[1]))
        if name == "resume":
            return self.resume(str(args[0]))
        if name == "status":
            return self.status()
        raise ValueError(f"unknown control request {name!r}")

    def serve(self, sock: socket.socket) -> None:
        """Serve one control connection (the daemon) until it closes."""
        try:
            while True:
                frame = protocol.recv_frame(sock, protocol.JOB_FRAME_LIMITS)
                try:
                    request = frame.value()
                    if frame.kind != protocol.CONTROL_REQUEST or type(request) is not list or not request:
                        raise ProtocolError("a control request is [name, *arguments]")
                    result = self.handle(request[0], tuple(request[1:]))
                    protocol.send_message(sock, protocol.CONTROL_OK, result)
                except Exception as e:
                    protocol.send_message(sock, protocol.CONTROL_FAILED, [type(e).__name__, str(e)])
        except (ConnectionError, OSError, EOFError):
            pass
        finally:
            sock.close()
