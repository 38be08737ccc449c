"""Job processes on the host: watching, signalling, re-adopting and measuring them.

A job's supervisor is not the daemon's child (the launcher exits at once), so the daemon watches
it through a pidfd and reads how it ended from the status file it writes. This works the same
for jobs this daemon started and for jobs a previous daemon started before it was killed.
`Processes` is what the daemon needs of all this; `HostProcesses` is the real thing, and unit
tests of the daemon's orchestration substitute a fake.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil

from singularityd.core.stimuli import Exited
from singularityd.jobs.launch import LaunchError, launch_spec, run_launcher
from singularityd.jobs.launcher import STATUS_RESERVE_BYTES, reserve_status
from singularityd.jobs.paths import JobPaths
from singularityd.store import JobRecord


@dataclass(frozen=True)
class ProcessId:
    """A process named for good: its host PID and its start time (a recycled PID differs)."""

    pid: int
    start_ticks: int


@dataclass(frozen=True)
class ExitStatus:
    """How a job's processes ended, as its supervisor recorded it."""

    exit_code: int | None
    signal: int | None
    error: str
    cpu_seconds: float | None
    max_rss_bytes: int | None

    def as_stimulus(self) -> Exited:
        """What this ending tells the job state machine."""
        return Exited(self.exit_code, self.signal, self.error, self.cpu_seconds, self.max_rss_bytes)


@dataclass(frozen=True)
class Usage:
    """A live sample of a job's processes."""

    cpu_seconds: float
    rss_bytes: int


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


def missing_status_reason(paths: JobPaths) -> str:
    """Why a job's supervisor ended without recording a status: the disk of the job's folder full
    (it could not write one), else it was killed."""
    try:
        full = shutil.disk_usage(paths.root).free < STATUS_RESERVE_BYTES
    except OSError:
        full = False
    if full:
        return f"the job's supervisor could not record its exit status: the disk holding {paths.root} is full"
    return "the job's supervisor was killed before it recorded an exit status"


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


class Watch(Protocol):
    """A watched supervisor: it can be signalled, and the watch closed."""

    def signal(self, sig: int) -> bool:
        """Send a signal; False if the process is already gone."""

    def close(self) -> None:
        """Stop watching (the exit callback will not be called)."""


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


class Processes(Protocol):
    """What the daemon needs from the operating system to run, watch and find jobs' processes."""

    def paths(self, job_id: int) -> JobPaths:
        """The job's folder."""

    async def launch(self, job: JobRecord, device_env: Mapping[str, str]) -> ProcessId:
        """Start the job's supervisor and ranks; raises LaunchError with the reason."""

    def watch(self, pid: int, on_exit: Callable[[], None]) -> Watch:
        """Call `on_exit` once when the supervisor ends."""

    def exit_status(self, job_id: int) -> ExitStatus | None:
        """How the job's processes ended, if its supervisor recorded it."""

    def recorded(self, job_id: int) -> ProcessId | None:
        """The supervisor the launcher recorded for the job, if any."""

    def alive(self, process: ProcessId) -> bool:
        """Whether this very process (not a recycled PID) still runs."""

    def usage(self, pid: int) -> Usage | None:
        """Live CPU time and memory of the job's process tree."""

    def forget_outcome(self, job_id: int) -> None:
        """Remove the status and PID files of an earlier run (before a restore)."""

    def adopt_restored(self, job_id: int, pid: int) -> ProcessId:
        """Record a restored supervisor as the job's process."""


class HostProcesses:
    """Job processes on this host: started through the launcher, watched through pidfds.

    With `user_namespaces` the jobs of users other than root run in user namespaces the daemon
    owns (root's keep the plain launch); with `private_network` every job gets a network of its
    own with only a loopback device.
    """

    def __init__(
        self,
        jobs_dir: Path,
        *,
        pid_namespace: bool,
        kill_grace_seconds: float,
        user_namespaces: bool = False,
        private_network: bool = False,
    ) -> None:
        self.jobs_dir = jobs_dir
        self.pid_namespace = pid_namespace
        self.kill_grace_seconds = kill_grace_seconds
        self.user_namespaces = user_namespaces
        self.private_network = private_network

    def paths(self, job_id: int) -> JobPaths:
        """The job's folder."""
        return JobPaths(self.jobs_dir / str(job_id))

    async def launch(self, job: JobRecord, device_env: Mapping[str, str]) -> ProcessId:
        """Start the job's supervisor and ranks; raises LaunchError with the reason."""
        paths = self.paths(job.id)
        try:
            spec = await asyncio.to_thread(
                launch_spec,
                job,
                paths,
                device_env,
                pid_namespace=self.pid_namespace,
                kill_grace_seconds=self.kill_grace_seconds,
                user_namespace=self.user_namespaces and job.spec.uid != 0,
                network_namespace=self.pid_namespace and self.private_network,
            )
            pid = await run_launcher(spec, paths)
        except OSError as error:
            raise LaunchError(str(error)) from None
        return ProcessId(pid, process_start_ticks(pid) or 0)

    def watch(self, pid: int, on_exit: Callable[[], None]) -> Watch:
        """Call `on_exit` once when the supervisor ends."""
        return ProcessWatch(pid, on_exit)

    def exit_status(self, job_id: int) -> ExitStatus | None:
        """How the job's processes ended, if its supervisor recorded it."""
        return read_exit_status(self.paths(job_id))

    def recorded(self, job_id: int) -> ProcessId | None:
        """The supervisor the launcher recorded for the job, if any."""
        found = read_pid_file(self.paths(job_id))
        return ProcessId(*found) if found is not None else None

    def alive(self, process: ProcessId) -> bool:
        """Whether this very process (not a recycled PID) still runs."""
        return process_start_ticks(process.pid) == process.start_ticks

    def usage(self, pid: int) -> Usage | None:
        """Live CPU time and memory of the job's process tree."""
        return usage(pid)

    def forget_outcome(self, job_id: int) -> None:
        """Remove the status and PID files of an earlier run (before a restore), and set room aside
        for the status the restored supervisor will write (it may come from another node)."""
        paths = self.paths(job_id)
        paths.status.unlink(missing_ok=True)
        paths.pid.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            reserve_status(str(paths.status))

    def adopt_restored(self, job_id: int, pid: int) -> ProcessId:
        """Record a restored supervisor as the job's process."""
        process = ProcessId(pid, process_start_ticks(pid) or 0)
        write_pid_file(self.paths(job_id), process.pid, process.start_ticks)
        return process
