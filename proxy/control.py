"""Daemon-facing control of proxy servers: quiesce, save, release, load, resume and stop a job.

Preempting a job whose processes use proxied devices goes like this (the daemon runs CRIU):

1. `ProxyControl(ctl).quiesce(job)` on every device of the job: each process stops at an
   operation boundary with nothing left in its sockets.
   Then `settle(job)` on every device, round after round, until `cut_reached`: no collective
   half done and none of the servers' messages in flight (a consistent cut of a multi-rank job).
2. `save(job, file)` on every device: only the job's live tensors are written, into a file the
   caller creates and whose descriptor travels with the request (the server never opens it).
3. For each job process: `criu dump -t PID ... *criu_dump_args(PID)` (the proxy sockets are
   declared external, so CRIU dumps the process without the server's half).
4. `release(job)` on every device frees its memory.

With a short pause (the daemon's way, singularityd/devices/saving.py), step 2 is split around
the quiesce: `prepare(job, file, rounds, ...)` pre-copies while the job runs; after the quiesce,
`capture(job, copy)` takes what changed; CRIU dumps; `resume(job)` (checkpoint in place) lets the
job go on at once, and `finish(job)` waits for the file. `pause_times(job)` says when the
processes parked and went on, by the clock every process here shares.

Resuming, on the same devices or others:

1. `load(job, file)` on the new device's server, for each device index of the job (a move may
   `preload(job, file, records)` the pre-copied storages before, while the job still runs on its
   source: `load` then reads only the rest).
2. `open_restored_connection(socket, job, rank, index)` for each process and device:
   a fresh connection the server already treats as that process's.
3. `criu restore --restore-detached ... *criu_restore_args(old_fds, new_socks)` with the new
   sockets passed down to CRIU (pass_fds).
4. `resume(job)` on every device: the processes go on where they stopped.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from singularity.proxy.bootstrap._singularity_proxy import protocol
from singularity.proxy.bootstrap._singularity_proxy.protocol import FD_BASE, FD_SPAN


class ControlError(RuntimeError):
    """A control request failed in the proxy server; the message is the server's, fit to show."""


class JobNotOnServer(ControlError):
    """The server has nothing of the job: its processes ended (or it never came to this device)."""


def control_socket_path(socket_path: str | os.PathLike[str]) -> Path:
    """The control socket of the server listening on `socket_path` (default naming)."""
    return Path(str(socket_path) + ".ctl")


class ProxyControl:
    """A connection to one proxy server's control socket."""

    def __init__(self, control_socket: str | os.PathLike[str], timeout: float | None = 120.0) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        self._sock.connect(os.fspath(control_socket))

    def close(self) -> None:
        """Close the control connection."""
        self._sock.close()

    def __enter__(self) -> ProxyControl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, *request: Any, fds: Sequence[int] = ()) -> Any:
        """Send one request (with file descriptors); its result, or ControlError with the failure."""
        socket.send_fds(self._sock, [b"\x00"], list(fds))
        protocol.send_message(self._sock, protocol.CONTROL_REQUEST, list(request))
        reply = protocol.recv_frame(self._sock)
        if reply.kind != protocol.CONTROL_OK:
            kind, message = reply.value()
            raise (JobNotOnServer if kind == protocol.CONTROL_JOB_NOT_HERE else ControlError)(str(message))
        return reply.value()

    def quiesce(self, job_id: str, timeout: float = 60.0) -> list[int]:
        """Stop every process of the job at an operation boundary; the ranks stopped.

        Returns once each connected process has acknowledged and has read everything
        the server sent, so that no byte of the job sits in a socket buffer.
        """
        return list(self._call("quiesce", job_id, timeout))

    def settle(self, job_id: str, timeout: float = 5.0) -> dict[str, Any]:
        """Wait (up to `timeout`) until nothing of the quiesced job can run on this server; its
        state for `cut_reached`: {"idle", "events", "sent": {index: n}, "received": {index: n}}."""
        return dict(self._call("settle", job_id, timeout))

    def save(self, job_id: str, path: str | os.PathLike[str]) -> dict[str, int]:
        """Write the quiesced job's live tensors (every rank) into a new file at `path`.

        The file is created here (mode 0600, owned by the caller) and only its descriptor is
        passed, so a server running as the job's user writes it without any right to the folder.
        Returns {"live_bytes", "file_bytes", "ranks"}.
        """
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            return dict(self._call("save", job_id, fds=[fd]))
        finally:
            os.close(fd)

    def prepare(
        self, job_id: str, path: str | os.PathLike[str], rounds: int, budget_s: float, stage: bool = True
    ) -> dict[str, Any]:
        """Begin saving the running job's device state into a new file at `path` (created here, as
        for `save`): up to `rounds` pre-copy rounds for at most `budget_s`, then, with `stage`,
        host memory made ready for what the pause will copy. The job keeps running.

        Returns the figures so far (see proxy/server/snapshot.py SaveReport).
        """
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            return dict(self._call("prepare", job_id, rounds, budget_s, stage, fds=[fd]))
        finally:
            os.close(fd)

    def capture(self, job_id: str, copy: bool) -> dict[str, Any]:
        """Take the quiesced job's device state for the save `prepare` began: what changed since its
        pre-copy is copied to host memory (`copy`, when the job will run again) or left to be read
        from the device (a preemption), and written in the background.

        Returns {"parked_at": [when each process parked, CLOCK_MONOTONIC], "copied_bytes",
        "reused_bytes", "copy_seconds"}."""
        return dict(self._call("capture", job_id, copy))

    def finish(self, job_id: str, timeout: float = 3600.0) -> dict[str, Any]:
        """Wait until the captured state is written; the save's figures (SaveReport)."""
        return dict(self._call("finish", job_id, timeout))

    def abort(self, job_id: str) -> None:
        """Abandon the job's save under way, if any."""
        self._call("abort", job_id)

    def pause_times(self, job_id: str) -> dict[str, list[float]]:
        """When the job's processes last parked and were let go: {"parked_at", "resumed_at"}, by
        CLOCK_MONOTONIC (the same clock as time.monotonic() in every process of the machine)."""
        return {k: [float(t) for t in v] for k, v in self._call("pause_times", job_id).items()}

    def release(self, job_id: str) -> int:
        """Free everything the job holds on this device; the bytes freed."""
        return int(self._call("release", job_id))

    def preload(
        self, job_id: str, path: str | os.PathLike[str], records: Sequence[tuple[int, int]]
    ) -> dict[str, Any]:
        """Read the pre-copied storage records [(offset, bytes)] of the device-state file at `path`
        into device memory held for the job, ahead of its `load` (which takes those its index names).
        Nothing is held when they do not fit. Returns {"preloaded_bytes", "records", "seconds",
        "refused"} (refused: why nothing was held, '' otherwise)."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            return dict(self._call("preload", job_id, [[int(o), int(n)] for o, n in records], fds=[fd]))
        finally:
            os.close(fd)

    def load(self, job_id: str, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Recreate a saved job's tensors on this server (any server) from the file at `path`,
        parked until resume (the file is opened here and passed as a descriptor). Storages that
        `preload` read are taken where the index names their record; the rest is read.
        Returns {"live_bytes", "ranks", "file_bytes", "preloaded_bytes" (taken),
        "unused_preloaded_bytes" (freed), "connected" (the sessions whose processes were connected
        when the job parked, to be reconnected: [rank, device index, process] each)}."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            return dict(self._call("load", job_id, fds=[fd]))
        finally:
            os.close(fd)

    def resume(self, job_id: str) -> list[int]:
        """Let the job's parked processes go on; the ranks resumed."""
        return list(self._call("resume", job_id))

    def status(self) -> dict[str, Any]:
        """Capacity, bytes in use, work done so far (operations, batches, busy_seconds), the
        share of the last second spent working (utilization_percent) and the jobs present on
        this device."""
        return dict(self._call("status"))

    def replicas(self, job_id: str) -> dict[str, Any]:
        """The job's memory on this device once what its ranks hold alike is shared (shared_bytes,
        private_bytes per rank, device_bytes; "measured" false: not compared yet, the figures are
        not a measurement) and whether its ranks here are data-parallel replicas ("replicas": "yes",
        "no" or "unknown", with "reason"); see proxy/server/dedup.py."""
        return dict(self._call("replicas", job_id))

    def stop(self) -> None:
        """Ask the server process to exit (its job no longer needs it)."""
        self._call("stop")


def splice_refusal(summaries: Sequence[Mapping[str, Any]]) -> str:
    """Why a job's ranks may not keep sharing devices, from its servers' `replicas` answers ('' when
    nothing says they are not data-parallel replicas: "unknown" does not refuse)."""
    for summary in summaries:
        if summary.get("replicas") == "no":
            return str(summary.get("reason") or "its ranks are not data-parallel replicas")
    return ""


def cut_reached(previous: Mapping[int, Any] | None, current: Mapping[int, Any]) -> bool:
    """Whether the job's servers (device index -> `settle` answer) show a consistent cut.

    Every server idle, every message sent between them taken, and nothing changed on any server
    since the previous round (asked after that whole round): then no collective can move any
    more, so each is complete for all its members or not started for any. A job on one device
    needs one idle answer.
    """
    if not current or not all(state["idle"] for state in current.values()):
        return False
    for index, state in current.items():
        for peer, sent in state["sent"].items():
            other = current.get(int(peer))
            if other is not None and other["received"].get(str(index), 0) != sent:
                return False
    if len(current) == 1 and not next(iter(current.values()))["sent"]:
        return True
    return previous is not None and dict(previous) == dict(current)


def client_sockets(pid: int) -> dict[int, tuple[int, int]]:
    """The proxy connections of a job process: {device index: (fd, socket inode)}."""
    out: dict[int, tuple[int, int]] = {}
    fd_dir = Path(f"/proc/{pid}/fd")
    for entry in fd_dir.iterdir():
        fd = int(entry.name)
        if fd < FD_BASE or fd >= FD_BASE + FD_SPAN:
            continue
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if target.startswith("socket:["):
            out[fd - FD_BASE] = (fd, int(target[len("socket:[") : -1]))
    return out


def criu_dump_args(pid: int) -> list[str]:
    """CRIU dump options declaring the process's proxy sockets external."""
    args: list[str] = []
    for _index, (_fd, inode) in sorted(client_sockets(pid).items()):
        args += ["--external", f"unix[{inode}]"]
    return args


def open_restored_connection(
    socket_path: str | os.PathLike[str],
    job_id: str,
    rank: int,
    device_index: int,
    process: int,
    timeout: float = 120.0,
) -> socket.socket:
    """Open the connection restored process `process` (its pid) will use for device `device_index`.

    The hello is done here on the process's behalf, so the server attaches the connection
    to the job's loaded state; the returned socket is inheritable, ready to be passed to
    `criu restore --inherit-fd`.
    """
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.settimeout(timeout)
    try:
        connection.connect(os.fspath(socket_path))
        protocol.send_message(connection, protocol.HELLO, [job_id, rank, device_index, True, process])
        welcome = protocol.recv_frame(connection)
    except BaseException:
        connection.close()
        raise
    if welcome.kind != protocol.WELCOME:
        connection.close()
        raise ControlError(str(welcome.value()[-1]))
    connection.settimeout(None)  # the restored process expects a blocking socket
    connection.set_inheritable(True)
    return connection


def criu_restore_args(
    old_sockets: Mapping[int, tuple[int, int]], new_sockets: Mapping[int, socket.socket]
) -> list[str]:
    """CRIU restore options putting each new connection in place of the dumped one.

    `old_sockets` is what `client_sockets(pid)` returned before the dump; `new_sockets`
    maps the same device indices to sockets from `open_restored_connection`, which must
    be passed to the criu process (e.g. subprocess pass_fds).
    """
    args: list[str] = []
    for index, (_fd, inode) in sorted(old_sockets.items()):
        args += ["--inherit-fd", f"fd[{new_sockets[index].fileno()}]:socket:[{inode}]"]
    return args
