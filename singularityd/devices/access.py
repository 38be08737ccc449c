"""How jobs reach their devices: the small interface the daemon and checkpoints depend on.

`ProxiedDevices` puts the daemon's per-job proxy servers (singularityd.devices.proxies) behind
it; `DirectDevices` hands jobs the devices themselves (proxies turned off). Whichever is wired in,
the rest of the daemon calls the same methods, and every failure arrives as one DeviceError.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from singularity.proxy.control import ControlError
from singularityd.devices.proxies import JobIdentity, JobProxies, ProxyConnection, ProxyError, job_connections

T = TypeVar("T")

STATUS_TIMEOUT_SECONDS = 2.0


@dataclass(frozen=True)
class DeviceSession:
    """One job rank's session on a device: the device memory it holds, whether it is connected."""

    job: int
    rank: int
    bytes: int
    connected: bool


@dataclass(frozen=True)
class DeviceHealth:
    """How the way to a device is doing, for people watching it (`sing top`, `sing devices`).

    `proxy` is "up", "idle" (its server starts on a job's first use of the device), "down: <why>",
    or "" where jobs use devices without proxies; `allocated` is the device memory the proxy
    server holds for jobs (None when it is not known).
    """

    proxy: str
    sessions: tuple[DeviceSession, ...] = ()
    allocated: int | None = None


def sessions_of(status: Mapping[str, Any]) -> tuple[DeviceSession, ...]:
    """The sessions in a proxy server's status ("job/rank" keys), in job and rank order."""
    sessions = []
    for key, session in status.get("jobs", {}).items():
        job, _, rank = str(key).partition("/")
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            sessions.append(
                DeviceSession(
                    int(job), int(rank), int(session.get("bytes", 0)), bool(session.get("connected"))
                )
            )
    return tuple(sorted(sessions, key=lambda s: (s.job, s.rank)))


class DeviceError(Exception):
    """The devices (their proxy servers) did not do what the daemon asked; the message says why."""


class DeviceAccess(Protocol):
    """What the daemon needs from whatever connects jobs to their devices."""

    def start(self) -> None:
        """Get ready to serve jobs (adopt the proxy servers of a previous run)."""

    def stop(self) -> None:
        """Stop taking new work; what jobs use keeps running."""

    async def admit(self, job_id: int, identity: JobIdentity, devices: Sequence[int]) -> None:
        """Let the job (its user's processes only) use these devices."""

    def forget(self, job_id: int) -> None:
        """The job holds no devices any more: nothing of it may stay on them."""

    def retain(self, job_ids: set[int]) -> None:
        """Only these jobs hold devices: forget every other (after a restart)."""

    def environment(
        self, job_id: int, devices: Sequence[int], inherited_pythonpath: str | None
    ) -> dict[str, str]:
        """What a job's processes need in their environment to reach their devices."""

    def connections(self, pids: Sequence[int]) -> list[ProxyConnection]:
        """Every proxy connection held by these processes of a job."""

    async def quiesce_and_save(self, job_id: int, devices: Sequence[int], images: Path) -> None:
        """Stop the job at an operation boundary and save its device state into `images`."""

    async def resume(self, job_id: int, devices: Sequence[int]) -> None:
        """Let the job's parked processes go on."""

    async def release(self, job_id: int, devices: Sequence[int]) -> None:
        """Free everything the job holds on these devices."""

    def reconnect(
        self, job_id: int, devices: Sequence[int], images: Path, connections: Sequence[Mapping[str, int]]
    ) -> tuple[dict[str, int], list[socket.socket]]:
        """Load saved device state and open the connections restored processes will inherit."""

    def health(self, device: int) -> DeviceHealth:
        """How the way to this device is doing (blocks for at most a couple of seconds)."""


def _translated(call: Callable[[], T]) -> T:
    """Run a proxy call, turning any of its failures into DeviceError."""
    try:
        return call()
    except (ProxyError, ControlError, OSError) as error:
        raise DeviceError(str(error)) from error


async def _translated_async(call: Awaitable[T]) -> T:
    """Await a proxy call, turning any of its failures into DeviceError."""
    try:
        return await call
    except (ProxyError, ControlError, OSError) as error:
        raise DeviceError(str(error)) from error


class ProxiedDevices:
    """Jobs reach their devices through proxy servers of their own, running as their user."""

    def __init__(self, pool: JobProxies) -> None:
        self.pool = pool

    def start(self) -> None:
        """Start the spawner and adopt the proxy servers still running."""
        _translated(self.pool.start)

    def stop(self) -> None:
        """Stop the spawner (running servers stay, for the jobs that use them)."""
        self.pool.stop()

    async def admit(self, job_id: int, identity: JobIdentity, devices: Sequence[int]) -> None:
        """Start the job's servers as its user, one per device."""
        await _translated_async(self.pool.admit(job_id, identity, devices))

    def forget(self, job_id: int) -> None:
        """Stop the job's servers and remove what they held."""
        self.pool.forget(job_id)

    def retain(self, job_ids: set[int]) -> None:
        """Stop the servers of jobs that no longer hold devices."""
        self.pool.retain(job_ids)

    def environment(
        self, job_id: int, devices: Sequence[int], inherited_pythonpath: str | None
    ) -> dict[str, str]:
        """The in-job client on PYTHONPATH and the sockets of the job's devices."""
        return self.pool.environment(job_id, devices, inherited_pythonpath)

    def connections(self, pids: Sequence[int]) -> list[ProxyConnection]:
        """Every proxy connection held by these processes of a job."""
        return job_connections(pids)

    async def quiesce_and_save(self, job_id: int, devices: Sequence[int], images: Path) -> None:
        """Stop the job at an operation boundary and save its live tensors."""
        await _translated_async(self.pool.quiesce_and_save(job_id, devices, images))

    async def resume(self, job_id: int, devices: Sequence[int]) -> None:
        """Let the job's parked processes go on."""
        await _translated_async(self.pool.resume(job_id, devices))

    async def release(self, job_id: int, devices: Sequence[int]) -> None:
        """Free everything the job holds on these devices."""
        await _translated_async(self.pool.release(job_id, devices))

    def reconnect(
        self, job_id: int, devices: Sequence[int], images: Path, connections: Sequence[Mapping[str, int]]
    ) -> tuple[dict[str, int], list[socket.socket]]:
        """Load the saved tensors into the servers and open the restored processes' connections."""
        return _translated(lambda: self.pool.reconnect(job_id, devices, images, connections))

    def health(self, device: int) -> DeviceHealth:
        """Idle while no job's server runs on it; then up, with its sessions, if the server answers."""
        if not self.pool.serving(device):
            return DeviceHealth("idle")
        status = self.pool.status(device, STATUS_TIMEOUT_SECONDS)
        if status is None:
            return DeviceHealth("down: its proxy server does not answer")
        return DeviceHealth("up", sessions_of(status), int(status.get("allocated", 0)))


class DirectDevices:
    """Jobs use the devices themselves: no proxies, so no device state to save or restore."""

    def __init__(self, nvml: bool) -> None:
        self.nvml = nvml

    def start(self) -> None:
        """Nothing to start."""

    def stop(self) -> None:
        """Nothing to stop."""

    async def admit(self, job_id: int, identity: JobIdentity, devices: Sequence[int]) -> None:
        """Nothing to admit: the job sees its devices through CUDA_VISIBLE_DEVICES."""

    def forget(self, job_id: int) -> None:
        """Nothing to forget."""

    def retain(self, job_ids: set[int]) -> None:
        """Nothing is held."""

    def environment(
        self, job_id: int, devices: Sequence[int], inherited_pythonpath: str | None
    ) -> dict[str, str]:
        """CUDA_VISIBLE_DEVICES for real GPUs; nothing for virtual devices."""
        if self.nvml:
            return {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in devices)}
        return {}

    def connections(self, pids: Sequence[int]) -> list[ProxyConnection]:
        """Proxy connections left from a daemon that had proxies (they are dumped as external)."""
        return job_connections(pids)

    async def quiesce_and_save(self, job_id: int, devices: Sequence[int], images: Path) -> None:
        """No device state is held outside the job."""

    async def resume(self, job_id: int, devices: Sequence[int]) -> None:
        """Nothing is parked."""

    async def release(self, job_id: int, devices: Sequence[int]) -> None:
        """Nothing is held."""

    def reconnect(
        self, job_id: int, devices: Sequence[int], images: Path, connections: Sequence[Mapping[str, int]]
    ) -> tuple[dict[str, int], list[socket.socket]]:
        """A checkpoint with proxy connections cannot be restored without proxies."""
        if connections:
            raise DeviceError("the job used device proxies, which are turned off in this daemon")
        return {}, []

    def health(self, device: int) -> DeviceHealth:
        """No proxy stands between jobs and the device."""
        return DeviceHealth("")
