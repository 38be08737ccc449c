"""Job processes on the daemon's side: launching, watching, signalling, re-adopting, measuring.

A job's supervisor is not the daemon's child (the launcher exits at once), so the daemon watches
it through a pidfd and reads how it ended from the status file it writes. This works the same
for jobs this daemon started and for jobs a previous daemon started before it was killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from singularityd import launcher

LAUNCHER = Path(launcher.__file__)


@dataclass(frozen=True)
class ExitStatus:
    """How a job's processes ended, as its supervisor recorded it."""

    exit_code: int | None
    signal: int | None
    error: str
    cpu_seconds: float | None
    max_rss_bytes: int | None


@dataclass(frozen=True)
class Usage:
    """A live sample of a job's processes."""

    cpu_seconds: float
    rss_bytes: int


class LaunchError(Exception):
    """The job's processes could not be started; the message says why."""


@dataclass(frozen=True)
class JobPaths:
    """Where one job's files live under the state directory."""

    root: Path

    @property
    def logs(self) -> Path:
        """Per-rank output, appended to across restarts."""
        return self.root / "logs"

    def rank_log(self, rank: int) -> Path:
        """stdout and stderr of one rank."""
        return self.logs / f"rank-{rank}.log"

    @property
    def supervisor_log(self) -> Path:
        """Messages of the job's supervisor itself."""
        return self.root / "supervisor.log"

    @property
    def status(self) -> Path:
        """Written by the supervisor when the job ends."""
        return self.root / "status.json"

    @property
    def pid(self) -> Path:
        """The supervisor's host PID, written by the launcher."""
        return self.root / "init.pid"

    @property
    def spec(self) -> Path:
        """The launch spec handed to the launcher."""
        return self.root / "launch.json"


def prepare_job_dir(paths: JobPaths) -> None:
    """Create the job's folders.

    As root they belong to root (mode 0711), so the files root writes there (status, PID, the
    logs it opens) cannot be swapped for links by the job's user; each log file is the user's
    own, readable by them alone. In user mode everything is the user's, mode 0700.
    """
    paths.logs.mkdir(parents=True, exist_ok=True)
    mode = 0o711 if os.geteuid() == 0 else 0o700
    for folder in (paths.root, paths.logs):
        if folder.is_symlink() or not folder.is_dir():
            raise LaunchError(f"{folder} is not a directory")
        os.chmod(folder, mode)
        if os.geteuid() == 0:
            os.chown(folder, 0, 0)


def free_tcp_port() -> int:
    """A TCP port on the loopback that is free now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def rank_environments(
    base: dict[str, str],
    *,
    job_id: int,
    user: str,
    ranks: int,
    devices: tuple[int, ...],
    device_env: Mapping[str, str],
    master_port: int,
) -> list[dict[str, str]]:
    """The environment of each rank: the user's, plus what torchrun and singularityd provide.

    USER and LOGNAME always name the job's real user, whatever the request carried.
    USE_LIBUV defaults to 0: torch's libuv TCPStore creates an io_uring, which CRIU cannot dump.
    `device_env` says how the job reaches its devices (the proxy client, or CUDA_VISIBLE_DEVICES).
    """
    identity = {"USER": user, "LOGNAME": user}
    defaults: dict[str, str] = {}
    try:
        account = pwd.getpwnam(user)
        defaults = {"HOME": account.pw_dir, "SHELL": account.pw_shell}
    except KeyError:
        pass
    listed = ",".join(str(d) for d in devices)
    environments = []
    defaults["USE_LIBUV"] = "0"
    for rank in range(ranks):
        env = {**defaults, **base, **identity}
        env.update(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "GROUP_RANK": "0",
                "WORLD_SIZE": str(ranks),
                "LOCAL_WORLD_SIZE": str(ranks),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(master_port),
                "SING_JOB_ID": str(job_id),
                "SING_DEVICES": listed,
            }
        )
        env.update(device_env)
        environments.append(env)
    return environments


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it does not exist.

    Together with the PID this names a process uniquely, so a recycled PID is never mistaken
    for a job's supervisor.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    if fields[0] == b"Z":
        return None
    return int(fields[19])


def write_pid_file(paths: JobPaths, pid: int, ticks: int) -> None:
    """Record the supervisor's host PID and start time (together they name one process)."""
    temporary = paths.pid.with_suffix(".tmp")
    temporary.write_text(f"{pid} {ticks}\n")
    temporary.replace(paths.pid)


def read_pid_file(paths: JobPaths) -> tuple[int, int] | None:
    """The supervisor's (PID, start ticks) as recorded, or None."""
    try:
        pid, ticks = (int(field) for field in paths.pid.read_text().split())
    except (OSError, ValueError):
        return None
    return pid, ticks


def read_exit_status(paths: JobPaths) -> ExitStatus | None:
    """The status the supervisor wrote, or None if it wrote none."""
    try:
        data: dict[str, Any] = json.loads(paths.status.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return ExitStatus(
        exit_code=data.get("exit_code"),
        signal=data.get("signal"),
        error=str(data.get("error") or ""),
        cpu_seconds=data.get("cpu_seconds"),
        max_rss_bytes=data.get("max_rss_bytes"),
    )


async def launch(spec: dict[str, Any], paths: JobPaths) -> tuple[int, int]:
    """Start a job through the launcher; returns the supervisor's host PID and start ticks."""
    for stale in (paths.status, paths.pid):
        stale.unlink(missing_ok=True)
    paths.spec.unlink(missing_ok=True)
    fd = os.open(paths.spec, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(spec, handle)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-S",
        str(LAUNCHER),
        str(paths.spec),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    if process.returncode != 0:
        detail = err.decode(errors="replace").strip().splitlines()
        raise LaunchError(detail[-1] if detail else f"launcher exited with {process.returncode}")
    pid = int(out.decode().strip())
    ticks = process_start_ticks(pid)
    return pid, ticks if ticks is not None else 0


class ProcessWatch:
    """Calls back once when a job's supervisor ends, whether or not the daemon is its parent."""

    def __init__(self, pid: int, on_exit: Callable[[], None]) -> None:
        self.pid = pid
        self._on_exit = on_exit
        self._loop = asyncio.get_running_loop()
        self.fd: int | None = None
        try:
            self.fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._loop.call_soon(on_exit)
            return
        self._loop.add_reader(self.fd, self._fire)

    def _fire(self) -> None:
        self.close()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, os.WNOHANG)
        self._on_exit()

    def signal(self, sig: int) -> bool:
        """Send a signal through the pidfd (never to a recycled PID); False if already gone."""
        if self.fd is None:
            return False
        try:
            signal.pidfd_send_signal(self.fd, sig)
        except ProcessLookupError:
            return False
        return True

    def close(self) -> None:
        """Stop watching and release the pidfd."""
        if self.fd is not None:
            self._loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = None


def usage(pid: int) -> Usage | None:
    """CPU time and resident memory of the supervisor and all its descendants."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    cpu = 0.0
    rss = 0
    for process in processes:
        try:
            with process.oneshot():
                times = process.cpu_times()
                cpu += times.user + times.system
                rss += process.memory_info().rss
        except psutil.Error:
            continue
    return Usage(cpu, rss)


def user_groups(user: str, gid: int) -> list[int]:
    """The supplementary groups the user's jobs run with."""
    try:
        return os.getgrouplist(user, gid)
    except OSError:
        return [gid]
