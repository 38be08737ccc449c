"""How jobs reach their devices: the small interface the daemon and checkpoints depend on.

`ProxiedDevices` puts the daemon's per-device proxy servers (singularityd.devices.proxies) behind
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
from singularityd.devices.proxies import ProxyConnection, ProxyError, ProxyPool, job_connections

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
        """Get ready to serve jobs (adopt or arm the proxy servers)."""

    def stop(self) -> None:
        """Stop taking new work; what jobs use keeps running."""

    def admit(self, job_id: int, uid: int, devices: Sequence[int]) -> None:
        """Let the job (processes of this uid only) use these devices."""

    def forget(self, job_id: int) -> None:
        """The job holds no devices any more."""

    def environment(self, devices: Sequence[int], inherited_pythonpath: str | None) -> dict[str, str]:
        """What a job's processes need in their environment to reach their devices."""

    def connections(self, pids: Sequence[int]) -> list[ProxyConnection]:
        """Every proxy connection held by these processes of a job."""

    async def quiesce_and_save(self, job_id: int, devices: Sequence[int], images: Path) -> None:
        """Stop the job at an operation boundary and save its device state into `images`."""

    async def resume(self, job_id: int, devices: Sequence[int]) -> None:
        """Let the job's parked processes go on."""

    async def release(self, job_id: int, devices: Sequence[int]) -> None:
        """Free everything the job holds on these devices."""

    async def prepare_restore(self, devices: Sequence[int]) -> None:
        """Make sure these devices can take a restored job's state."""

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
    """Jobs reach their devices through the daemon's per-device proxy servers."""

    def __init__(self, pool: ProxyPool) -> None:
        self.pool = pool

    def start(self) -> None:
        """Adopt the proxy servers still running; arm socket activation for the others."""
        self.pool.start()

    def stop(self) -> None:
        """Stop listening for activations (running servers stay, for the jobs that use them)."""
        self.pool.stop()

    def admit(self, job_id: int, uid: int, devices: Sequence[int]) -> None:
        """Let processes of this uid open sessions for the job, on its devices only."""
        _translated(lambda: self.pool.admit(job_id, uid, devices))

    def forget(self, job_id: int) -> None:
        """No new proxy sessions for the job."""
        self.pool.forget(job_id)

    def environment(self, devices: Sequence[int], inherited_pythonpath: str | None) -> dict[str, str]:
        """The in-job client on PYTHONPATH and the sockets of the job's devices."""
        return self.pool.environment(devices, inherited_pythonpath)

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

    async def prepare_restore(self, devices: Sequence[int]) -> None:
        """Start the servers of these devices and wait until they answer."""
        for device in devices:
            await _translated_async(self.pool.ensure_running(device))

    def reconnect(
        self, job_id: int, devices: Sequence[int], images: Path, connections: Sequence[Mapping[str, int]]
    ) -> tuple[dict[str, int], list[socket.socket]]:
        """Load the saved tensors into the servers and open the restored processes' connections."""
        return _translated(lambda: self.pool.reconnect(job_id, devices, images, connections))

    def health(self, device: int) -> DeviceHealth:
        """Idle until its server starts; then up, with its sessions, if the server answers."""
        if not self.pool.running(device):
            return DeviceHealth("idle")
        try:
            status = _translated(lambda: self.pool.status(device, STATUS_TIMEOUT_SECONDS))
        except DeviceError as error:
            return DeviceHealth(f"down: {error}")
        return DeviceHealth("up", sessions_of(status), int(status.get("allocated", 0)))


class DirectDevices:
    """Jobs use the devices themselves: no proxies, so no device state to save or restore."""

    def __init__(self, nvml: bool) -> None:
        self.nvml = nvml

    def start(self) -> None:
        """Nothing to start."""

    def stop(self) -> None:
        """Nothing to stop."""

    def admit(self, job_id: int, uid: int, devices: Sequence[int]) -> None:
        """Nothing to admit: the job sees its devices through CUDA_VISIBLE_DEVICES."""

    def forget(self, job_id: int) -> None:
        """Nothing to forget."""

    def environment(self, devices: Sequence[int], inherited_pythonpath: str | None) -> dict[str, str]:
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

    async def prepare_restore(self, devices: Sequence[int]) -> None:
        """Nothing to prepare."""

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
