"""The server's side of the daemon's control channel: quiesce, save, release, preload, load, resume,
status, replicas, stop.

Saves with a short pause (prepare, capture, finish) are snapshot.py's; the file they write is
statefile.py's; reading its pre-copied storages ahead of a restore (preload) is preloads.py's.

Requests come from the daemon (proxy/control.py is its client) on a socket no job can open: the
daemon binds it in a folder only root can enter and hands the server the listening descriptor.
Each request names a job; the handler parks, saves, frees, recreates or resumes that job's
sessions in the Server it was given, and answers with the result or the failure. Device state
is written to and read from files the daemon opened and passes with the request (SCM_RIGHTS),
so the server, which runs as the job's user, never opens a path in the checkpoint store.

Every control message starts with one marker byte sent with sendmsg, carrying the request's
file descriptors (often none), followed by a protocol frame [name, *arguments].
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Any

import torch

from singularity.proxy.bootstrap._singularity_proxy import protocol
from singularity.proxy.bootstrap._singularity_proxy.protocol import ProtocolError

from .preloads import Preloads
from .service import Server
from .session import UNKNOWN_DEVICE, JobNotHere, Session, error_message
from .snapshot import SNAPSHOT_REQUESTS, Snapshots
from .statefile import read_state

MAX_CONTROL_FDS = 4


def control_failure(error: BaseException) -> list[str]:
    """What a failed control request answers: [kind, message]. The kind says whether the job has
    nothing here (it ended: protocol.CONTROL_JOB_NOT_HERE) or something else failed; the message
    is the error's own text, which the daemon shows as it is (no Python class names or quoting)."""
    kind = protocol.CONTROL_JOB_NOT_HERE if isinstance(error, JobNotHere) else protocol.CONTROL_ERROR
    return [kind, error_message(error) or "proxy: the request failed without saying why"]


class ControlHandler:
    """Carries out the daemon's requests on one Server."""

    def __init__(self, server: Server, stop: threading.Event | None = None) -> None:
        self.server = server
        self.stop_requested = stop or threading.Event()
        """Set by a stop request: the server process then exits."""
        self.snapshots = Snapshots(server)
        """Saves of device state under way (pre-copy, capture in the pause, the write after)."""
        self.preloads = Preloads(server)
        """Device state read ahead of a job's restore (its pre-copied storages)."""

    def quiesce(self, job_id: str, timeout: float) -> list[int]:
        """Park every connected process of the job at an operation boundary; the ranks parked."""
        deadline = time.monotonic() + timeout
        sessions = self.server.job_sessions(job_id)
        for session in sessions:
            session.park_asked = True  # also a session whose process ended: it stays, as it is
            if session.connection is not None and not session.parked:
                session.parked_event.clear()
                session.connection.send(protocol.PARK)
        parked = []
        for session in sessions:
            connection = session.connection
            session.connected_when_parked = connection is not None
            if connection is None:
                session.parked = True
                parked.append(session.rank)
                continue
            arrived = session.parked_event.wait(max(0.0, deadline - time.monotonic()))
            if not arrived and not session.parked:
                raise TimeoutError(f"job {job_id} rank {session.rank} did not park in {timeout}s")
            if not session.parked:  # the process ended meanwhile: its session is saved as it is
                session.connected_when_parked = False
                session.parked = True
                parked.append(session.rank)
                continue
            while connection.unread_bytes() > 0:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {job_id} rank {session.rank}: channel not drained")
                time.sleep(0.001)
            parked.append(session.rank)
        # collectives: what the parked processes sent runs until nothing more can (runner.py)
        if not self.server.wait_idle(job_id, max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"job {job_id}: its sessions did not come to rest in {timeout}s")
        self.server.dedup.share_job(job_id)  # ranks sharing the device: their replicas saved once
        return parked

    def save(self, job_id: str, fd: int) -> dict[str, Any]:
        """Write the live tensors of a quiesced job, every rank, into the file open at `fd`."""
        return self.snapshots.save_now(job_id, fd)

    def release(self, job_id: str) -> int:
        """Free everything the job holds here, closing its connections; the bytes freed."""
        self.snapshots.abort(job_id)
        freed = self.preloads.drop(job_id)
        for session in self.server.job_sessions(job_id):
            freed += session.held_bytes
            connection = session.connection
            session.connection = None
            if connection is not None:
                with contextlib.suppress(OSError):
                    connection.sock.shutdown(socket.SHUT_RDWR)
            self.server.drop(session)
        self.server.collectives.forget(job_id)
        self.server.dedup.forget(job_id)
        return freed

    def load(self, job_id: str, fd: int) -> dict[str, Any]:
        """Recreate a saved job's tensors here from the file open at `fd`, parked until resume (taking
        the storages preloaded for it that the file's index names; the rest are freed). Says which
        sessions had a connection to reconnect ([rank, device index, process] each)."""
        server = self.server
        preloaded = self.preloads.take(job_id)
        preloaded_bytes = sum(storage.nbytes() for storage in preloaded.values())
        _device, saved = read_state(fd, server.device, preloaded)
        taken_bytes = preloaded_bytes - sum(storage.nbytes() for storage in preloaded.values())
        preloaded.clear()
        loaded = 0
        with server.executor.lock:
            for state in saved:
                index = UNKNOWN_DEVICE if state.index is None else state.index
                with server.state_lock:
                    if (job_id, state.rank, index, state.process) in server.sessions:
                        raise RuntimeError(f"proxy: job {job_id} rank {state.rank} cuda:{index} already here")
                    session = Session(job_id, state.rank, state.uid, server.memory, index, state.process)
                    session.parked = True
                    session.parked_event.set()
                    for op_id, (namespace, name, overload) in state.ops.items():
                        session.define(op_id, namespace, name, overload)
                    session.restore_plans(state.plans, server.device)
                    handles: list[int] = []
                    for handle, tensor in state.tensors.items():
                        session.add(handle, tensor)
                        handles.append(handle)
                    session.peak_bytes = max(session.held_bytes, state.peak)
                    session.pending_error = state.pending_error
                    session.settings = state.settings
                    server.add_session(session, state.queue, state.groups)  # held until resume
                    try:
                        session.check_capacity(handles, session.held_bytes)
                    except torch.OutOfMemoryError:
                        server.drop(session)
                        raise
                    loaded += session.held_bytes
            server.dedup.share_job_locked(job_id)
        return {
            "live_bytes": loaded,
            "ranks": len(saved),
            "file_bytes": os.fstat(fd).st_size,
            "preloaded_bytes": taken_bytes,
            "unused_preloaded_bytes": preloaded_bytes - taken_bytes,
            "connected": [
                [state.rank, UNKNOWN_DEVICE if state.index is None else state.index, state.process]
                for state in saved
                if state.connected
            ],
        }

    def resume(self, job_id: str) -> list[int]:
        """Let the job's parked processes go on; the ranks resumed."""
        for runner in self.server.job_runners(job_id):
            runner.release_hold()  # restored sessions run the work they had not run
        ranks = []
        for session in self.server.job_sessions(job_id):
            if session.parked and session.connection is not None:
                session.parked = False
                session.park_asked = False
                session.parked_event.clear()
                session.connection.send(protocol.RESUME)
                session.resumed_at = time.monotonic()
                ranks.append(session.rank)
            elif session.connection is None:  # its process ended before the checkpoint
                with self.server.state_lock:
                    session.parked = False
                    session.park_asked = False
                    retired = session.retiring  # the thread retiring it goes on
                if not retired:
                    threading.Thread(target=self.server.retire, args=(session,), daemon=True).start()
        return ranks

    def replicas(self, job_id: str) -> dict[str, Any]:
        """The job's memory here after sharing what its ranks hold alike, and whether its ranks here
        are data-parallel replicas (dedup.Dedup.summary)."""
        return {**self.server.dedup.summary(job_id), **self.server.squash.figures()}

    def status(self) -> dict[str, Any]:
        """Capacity, bytes in use, work done so far and the sessions present on this device."""
        server = self.server
        executor = server.executor
        with server.state_lock:
            jobs = {job for job, *_ in server.sessions}
        squashing = server.squash.figures()
        splicing = {job: {**server.dedup.summary(job, share=False), **squashing} for job in sorted(jobs)}
        with server.state_lock:
            processes: dict[
                str, dict[str, Any]
            ] = {}  # a process's sessions of several devices here: one entry
            for (job, rank, *_), session in server.sessions.items():
                seen = processes.setdefault(
                    f"{job}/{rank}", {"bytes": 0, "parked": True, "waiting": False, "connected": False}
                )
                seen["bytes"] += session.held_bytes
                seen["parked"] = seen["parked"] and session.parked
                seen["waiting"] = seen["waiting"] or session.waiting
                seen["connected"] = seen["connected"] or session.connection is not None
            return {
                "splicing": splicing,
                "index": server.index,
                "capacity": server.memory.capacity,
                "allocated": server.memory.used - server.memory.kept_bytes,
                "kept": server.memory.kept_bytes,
                "peak": server.memory.peak,
                "swapped": server.memory.swapped_bytes,
                "swapped_total": server.memory.swapped_total,
                "dedup": {
                    "compare_seconds": server.dedup.compare_seconds,
                    "compared_bytes": server.dedup.compared_bytes,
                    "copied_bytes": server.memory.copied_bytes,
                    **squashing,
                },
                "operations": executor.operations,
                "batches": executor.batches,
                "busy_seconds": executor.busy.total_seconds,
                "utilization_percent": executor.busy.utilization_percent(time.perf_counter()),
                "jobs": processes,
                "preloaded": self.preloads.held_bytes(),
            }

    def handle(self, name: str, args: tuple[Any, ...], fds: list[int]) -> Any:
        """Carry out one control request (with the descriptors that came with it); its result."""
        if name in SNAPSHOT_REQUESTS:
            return self.snapshots.handle(name, args, fds)
        if name == "quiesce":
            return self.quiesce(str(args[0]), float(args[1]))
        if name == "settle":
            return self.server.settle(str(args[0]), float(args[1]))
        if name == "preload":
            if len(fds) != 1:
                raise ValueError("a preload request carries exactly one file descriptor")
            return self.preloads.preload(str(args[0]), fds[0], args[1])
        if name in ("save", "load"):
            if len(fds) != 1:
                raise ValueError(f"a {name} request carries exactly one file descriptor")
            return (self.save if name == "save" else self.load)(str(args[0]), fds[0])
        if name == "release":
            return self.release(str(args[0]))
        if name == "stop":
            self.stop_requested.set()
            return None
        if name == "resume":
            return self.resume(str(args[0]))
        if name == "status":
            return self.status()
        if name == "replicas":
            return self.replicas(str(args[0]))
        raise ValueError(f"unknown control request {name!r}")

    def serve(self, sock: socket.socket) -> None:
        """Serve one control connection (the daemon) until it closes."""
        try:
            while True:
                marker, fds, _flags, _address = socket.recv_fds(sock, 1, MAX_CONTROL_FDS)
                if not marker:
                    return
                try:
                    frame = protocol.recv_frame(sock, protocol.JOB_FRAME_LIMITS)
                    request = frame.value()
                    if frame.kind != protocol.CONTROL_REQUEST or type(request) is not list or not request:
                        raise ProtocolError("a control request is [name, *arguments]")
                    result = self.handle(request[0], tuple(request[1:]), fds)
                    protocol.send_message(sock, protocol.CONTROL_OK, result)
                except Exception as e:
                    protocol.send_message(sock, protocol.CONTROL_FAILED, control_failure(e))
                finally:
                    for fd in fds:
                        with contextlib.suppress(OSError):
                            os.close(fd)
        except (ConnectionError, OSError, EOFError):
            pass
        finally:
            sock.close()
