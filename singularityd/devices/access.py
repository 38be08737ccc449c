"""How jobs reach their devices: the small interface the daemon and checkpoints depend on.

`ProxiedDevices` puts the daemon's per-job proxy servers (singularityd.devices.proxies) behind
it; `DirectDevices` hands jobs the devices themselves (proxies turned off). Whichever is wired in,
the rest of the daemon calls the same methods, and every failure arrives as one DeviceError.
A checkpoint saves the job's device state through a `DeviceStateSave` (`device_save`): pre-copy
while the job runs, park, capture in the pause, finish writing after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from singularity.proxy.control import ControlError, JobNotOnServer, ProxyControl
from singularityd.checkpoint.pause import DeviceSaveFigures
from singularityd.devices.proxies import (
    JobProxies,
    ProxyConnection,
    Reconnection,
    device_state_file,
    job_connections,
    write_precopied_records,
)
from singularityd.devices.proxy_servers import JobIdentity, ProxyError
from singularityd.devices.splicing import SavedLayout

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

    `proxy` is "up", "idle" (no job's server runs on it), "starting" (a job's server is being
    spawned; the job's connections wait for it), "down: <why>",
    or "" where jobs use devices without proxies; `allocated` is the device memory the proxy
    server holds for jobs and `utilization_percent` the share of the last second it spent running
    their work (None when not known).
    """

    proxy: str
    sessions: tuple[DeviceSession, ...] = ()
    allocated: int | None = None
    utilization_percent: float | None = None


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


class JobGoneFromDevice(DeviceError):
    """A proxy server has nothing of the job: its processes ended meanwhile."""


@dataclass(frozen=True)
class PreCopy:
    """How much of a job's device state its proxies copy while it runs, before the pause."""

    rounds: int = 2
    """Pre-copy rounds (0: none, everything is copied in the pause)."""
    budget_s: float = 120.0
    """The longest the pre-copy may take."""


@dataclass(frozen=True)
class PauseStamps:
    """When the job's processes last parked and were let go (CLOCK_MONOTONIC), over all its devices."""

    parked_at: tuple[float, ...] = ()
    resumed_at: tuple[float, ...] = ()


class DeviceStateSave(Protocol):
    """One save of a job's device state, in the steps a checkpoint takes around its pause."""

    async def prepare(self) -> None:
        """While the job runs: pre-copy its state and make host memory ready for the pause."""

    async def park(self) -> None:
        """Stop the job's processes at an operation boundary (the pause begins)."""

    async def capture(self, copy: bool) -> None:
        """Take the parked state: copy what changed (`copy`), or leave it to be read from the device."""

    async def stamps(self) -> PauseStamps:
        """When the processes parked and were let go."""

    async def finish(self) -> DeviceSaveFigures:
        """Wait until the state is written; what the save cost."""

    async def abort(self) -> None:
        """Abandon the save (the checkpoint failed)."""


class NoDeviceState:
    """A job that holds no device state outside its processes: nothing to save."""

    async def prepare(self) -> None:
        """Nothing to pre-copy."""

    async def park(self) -> None:
        """Nothing to park: CRIU's freeze is the pause."""

    async def capture(self, copy: bool) -> None:
        """Nothing to capture."""

    async def stamps(self) -> PauseStamps:
        """No process parked."""
        return PauseStamps()

    async def finish(self) -> DeviceSaveFigures:
        """Nothing was written."""
        return DeviceSaveFigures()

    async def abort(self) -> None:
        """Nothing to abandon."""


class DeviceAccess(Protocol):
    """What the daemon needs from whatever connects jobs to their devices."""

    def start(self) -> None:
        """Get ready to serve jobs (adopt the proxy servers of a previous run)."""

    def stop(self) -> None:
        """Stop taking new work; what jobs use keeps running."""

    async def admit(
        self, job_id: int, identity: JobIdentity, devices: Sequence[int], logical: int | None = None
    ) -> None:
        """Let the job (its user's processes only) use these devices, seen as `logical` devices
        (default: as many as it holds; splicing.py)."""

    def forget(self, job_id: int) -> None:
        """The job holds no devices any more: nothing of it may stay on them."""

    def retain(self, job_ids: set[int]) -> None:
        """Only these jobs hold devices: forget every other (after a restart)."""

    def environment(
        self,
        job_id: int,
        devices: Sequence[int],
        inherited_pythonpath: str | None,
        logical: int | None = None,
    ) -> dict[str, str]:
        """What a job's processes need in their environment to reach their devices."""

    def connections(self, pids: Sequence[int]) -> list[ProxyConnection]:
        """Every proxy connection held by these processes of a job."""

    async def quiesce_and_save(self, job_id: int, devices: Sequence[int], images: Path) -> None:
        """Stop the job at an operation boundary and save its device state into `images`."""

    def device_save(
        self, job_id: int, devices: Sequence[int], images: Path, pre_copy: PreCopy
    ) -> DeviceStateSave:
        """A save of the job's device state into `images`, to be carried out step by step."""

    async def resume(self, job_id: int, devices: Sequence[int]) -> None:
        """Let the job's parked processes go on."""

    async def release(self, job_id: int, devices: Sequence[int]) -> None:
        """Free everything the job holds on these devices."""

    def reconnect(
        self,
        job_id: int,
        devices: Sequence[int],
        images: Path,
        connections: Sequence[Mapping[str, int]],
        layout: SavedLayout | None = None,
    ) -> Reconnection:
        """Load saved device state and open the connections restored processes will inherit."""

    async def preload(self, job_id: int, devices: Sequence[int], images: Path) -> list[dict[str, Any]]:
        """Read the pre-copied part of the device state in `images` onto the job's devices, ahead
        of `reconnect` (a move's target, while the job still runs on its source); what each device
        did (none where no proxy holds device state)."""

    def health(self, device: int) -> DeviceHealth:
        """How the way to this device is doing (blocks for at most a couple of seconds)."""

    def lost(self, job_id: int) -> str:
        """How the job lost its way to a device while it held it ('' if it did not), for its failure."""

    async def verdicts(self, job_id: int, devices: Sequence[int]) -> list[dict[str, Any]]:
        """What each of the job's devices says of its ranks there: data-parallel replicas or not
        (proxy/control.py `replicas`; none where no proxy judges)."""


def _device_error(error: ProxyError | ControlError | OSError) -> DeviceError:
    """The DeviceError a proxy call's failure means (JobGoneFromDevice: the job's processes ended)."""
    return (JobGoneFromDevice if isinstance(error, JobNotOnServer) else DeviceError)(str(error))


def _translated(call: Callable[[], T]) -> T:
    """Run a proxy call, turning any of its failures into DeviceError."""
    try:
        return call()
    except (ProxyError, ControlError, OSError) as error:
        raise _device_error(error) from error


async def _translated_async(call: Awaitable[T]) -> T:
    """Await a proxy call, turning any of its failures into DeviceError."""
    try:
        return await call
    except (ProxyError, ControlError, OSError) as error:
        raise _device_error(error) from error


class ProxyStateSave:
    """A save of a job's device state by its proxy servers, all devices at once."""

    def __init__(
        self, pool: JobProxies, job_id: int, devices: Sequence[int], images: Path, pre_copy: PreCopy
    ) -> None:
        self.pool = pool
        self.job = str(job_id)
        self.job_id = job_id
        self.devices = tuple(devices)
        self.images = images
        self.pre_copy = pre_copy

    async def _all(self, call: Callable[[ProxyControl, int], Any]) -> list[Any]:
        return await _translated_async(self.pool.on_servers(self.job_id, self.devices, call))

    async def prepare(self) -> None:
        """Pre-copy on every device while the job runs, then stage host memory for the pause."""
        device_state_file(self.images, 0).parent.mkdir(parents=True, exist_ok=True)
        rounds, budget = self.pre_copy.rounds, self.pre_copy.budget_s

        def prepare(proxy: ProxyControl, index: int) -> Any:
            report = proxy.prepare(self.job, device_state_file(self.images, index), rounds, budget)
            write_precopied_records(self.images, index, report.get("precopy_records") or [])
            return report

        await self._all(prepare)

    async def park(self) -> None:
        """Quiesce the job on every device, then wait for a consistent cut of its collectives."""
        await self._all(lambda proxy, _: proxy.quiesce(self.job))
        await _translated_async(self.pool.settle(self.job_id, self.devices))

    async def capture(self, copy: bool) -> None:
        """Capture the parked state on every device."""
        await self._all(lambda proxy, _: proxy.capture(self.job, copy))

    async def stamps(self) -> PauseStamps:
        """When the processes parked and were let go, over all devices."""
        times = await self._all(lambda proxy, _: proxy.pause_times(self.job))
        return PauseStamps(
            tuple(t for each in times for t in each["parked_at"]),
            tuple(t for each in times for t in each["resumed_at"]),
        )

    async def finish(self) -> DeviceSaveFigures:
        """Wait for every device's file; their figures together."""
        return DeviceSaveFigures.summed(await self._all(lambda proxy, _: proxy.finish(self.job)))

    async def abort(self) -> None:
        """Abandon the save on every device."""
        await self._all(lambda proxy, _: proxy.abort(self.job))


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

    async def admit(
        self, job_id: int, identity: JobIdentity, devices: Sequence[int], logical: int | None = None
    ) -> None:
        """Start the job's servers as its user, one per device."""
        await _translated_async(self.pool.admit(job_id, identity, devices, logical))

    def forget(self, job_id: int) -> None:
        """Stop the job's servers and remove what they held."""
        self.pool.forget(job_id)

    def retain(self, job_ids: set[int]) -> None:
        """Stop the servers of jobs that no longer hold devices."""
        self.pool.retain(job_ids)

    def environment(
        self,
        job_id: int,
        devices: Sequence[int],
        inherited_pythonpath: str | None,
        logical: int | None = None,
    ) -> dict[str, str]:
        """The in-job client on PYTHONPATH and the sockets of the job's devices."""
        return self.pool.environment(job_id, devices, inherited_pythonpath, logical)

    def connections(self, pids: Sequence[int]) -> list[ProxyConnection]:
        """Every proxy connection held by these processes of a job."""
        return job_connections(pids)

    async def quiesce_and_save(self, job_id: int, devices: Sequence[int], images: Path) -> None:
        """Stop the job at an operation boundary and save its live tensors."""
        await _translated_async(self.pool.quiesce_and_save(job_id, devices, images))

    def device_save(
        self, job_id: int, devices: Sequence[int], images: Path, pre_copy: PreCopy
    ) -> DeviceStateSave:
        """A save by the job's proxy servers (see ProxyStateSave)."""
        return ProxyStateSave(self.pool, job_id, devices, images, pre_copy)

    async def resume(self, job_id: int, devices: Sequence[int]) -> None:
        """Let the job's parked processes go on."""
        await _translated_async(self.pool.resume(job_id, devices))

    async def release(self, job_id: int, devices: Sequence[int]) -> None:
        """Free everything the job holds on these devices."""
        await _translated_async(self.pool.release(job_id, devices))

    def reconnect(
        self,
        job_id: int,
        devices: Sequence[int],
        images: Path,
        connections: Sequence[Mapping[str, int]],
        layout: SavedLayout | None = None,
    ) -> Reconnection:
        """Load the saved tensors into the servers and open the restored processes' connections."""
        return _translated(lambda: self.pool.reconnect(job_id, devices, images, connections, layout))

    async def preload(self, job_id: int, devices: Sequence[int], images: Path) -> list[dict[str, Any]]:
        """Have the job's servers read the pre-copied device state in `images` (JobProxies.preload)."""
        return await _translated_async(self.pool.preload(job_id, devices, images))

    async def verdicts(self, job_id: int, devices: Sequence[int]) -> list[dict[str, Any]]:
        """Each running server's verdict on the job's ranks there, as its status reports it (read
        as the last collective left it: nothing is compared and the job is not stopped)."""
        job = str(job_id)

        def verdict(proxy: ProxyControl, _: int) -> dict[str, Any]:
            return dict(proxy.status().get("splicing", {}).get(job, {}))

        return await _translated_async(self.pool.on_servers(job_id, devices, verdict, STATUS_TIMEOUT_SECONDS))

    def lost(self, job_id: int) -> str:
        """How the first of the job's proxy servers that ended under it ended ('' if none did)."""
        return self.pool.lost(job_id)

    def health(self, device: int) -> DeviceHealth:
        """Idle while no job's server runs on it, starting while one is being spawned; then up,
        with its sessions, if the server answers."""
        if not self.pool.serving(device):
            return DeviceHealth("starting" if self.pool.starting(device) else "idle")
        status = self.pool.status(device, STATUS_TIMEOUT_SECONDS)
        if status is None:
            return DeviceHealth("down: its proxy server does not answer")
        utilization = status.get("utilization_percent")
        return DeviceHealth(
            "up",
            sessions_of(status),
            int(status.get("allocated", 0)),
            float(utilization) if isinstance(utilization, int | float) else None,
        )


class DirectDevices:
    """Jobs use the devices themselves: no proxies, so no device state to save or restore."""

    def __init__(self, nvml: bool) -> None:
        self.nvml = nvml

    def start(self) -> None:
        """Nothing to start."""

    def stop(self) -> None:
        """Nothing to stop."""

    async def admit(
        self, job_id: int, identity: JobIdentity, devices: Sequence[int], logical: int | None = None
    ) -> None:
        """Nothing to admit: the job sees its devices through CUDA_VISIBLE_DEVICES."""

    def forget(self, job_id: int) -> None:
        """Nothing to forget."""

    def retain(self, job_ids: set[int]) -> None:
        """Nothing is held."""

    def environment(
        self,
        job_id: int,
        devices: Sequence[int],
        inherited_pythonpath: str | None,
        logical: int | None = None,
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

    def device_save(
        self, job_id: int, devices: Sequence[int], images: Path, pre_copy: PreCopy
    ) -> DeviceStateSave:
        """No device state is held outside the job."""
        return NoDeviceState()

    async def resume(self, job_id: int, devices: Sequence[int]) -> None:
        """Nothing is parked."""

    async def release(self, job_id: int, devices: Sequence[int]) -> None:
        """Nothing is held."""

    def reconnect(
        self,
        job_id: int,
        devices: Sequence[int],
        images: Path,
        connections: Sequence[Mapping[str, int]],
        layout: SavedLayout | None = None,
    ) -> Reconnection:
        """A checkpoint with proxy connections cannot be restored without proxies."""
        if connections:
            raise DeviceError("the job used device proxies, which are turned off in this daemon")
        return Reconnection({}, [])

    async def preload(self, job_id: int, devices: Sequence[int], images: Path) -> list[dict[str, Any]]:
        """No proxy holds device state."""
        return []

    async def verdicts(self, job_id: int, devices: Sequence[int]) -> list[dict[str, Any]]:
        """No proxy judges the job's ranks."""
        return []

    def lost(self, job_id: int) -> str:
        """No proxy stands between jobs and the device: none can end under a job."""
        return ""

    def health(self, device: int) -> DeviceHealth:
        """No proxy stands between jobs and the device."""
        return DeviceHealth("")
