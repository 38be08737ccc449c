"""A move's target reads the device state pre-copied on its source onto its own devices while the job
still runs there, so that the frozen restore after the stop reads only what changed since.

The source sends the front of each device-state file (the storages its pre-copy wrote, which never
change afterwards), the records that part holds (`cudaN.precopied`, proxies.py) and whom the job
runs as (jobfiles.PRECOPY_OWNER_FILE) before it stops the job. Once every chunk of that transfer
has arrived and been checked (transfer_grpc.Receivers calls `received`), the target starts the
job's proxy servers on devices free now and has them read those records into device memory
(proxy/server/preloads.py); the sender is answered once that is done (at most
transfer_grpc.SETTLE_WAIT_S), so it stops the job only then and the preload is not part of the
downtime. The restore takes those servers and devices when they are still free
and the record names the same owner and number of devices (else it starts afresh: the preloaded
state goes with the servers). A preload only uses devices free at the time, and holds them until
the restore takes them or the preload is dropped: neither local jobs (the daemon's
`reserved_devices`) nor other arriving jobs get them meanwhile.
A discarded epoch, or a restart of the daemon (its servers of jobs it does not hold are stopped),
drops what was preloaded with the servers holding it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from singularityd import faults
from singularityd.daemon import Daemon
from singularityd.devices.access import DeviceError
from singularityd.devices.proxy_servers import JobIdentity
from singularityd.federation import jobfiles
from singularityd.federation.handoff import Phase
from singularityd.federation.holdings import StoredHoldings
from singularityd.jobs.launch import user_groups
from singularityd.units import counted, human_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preloaded:
    """The servers an arriving epoch's pre-copied device state was preloaded into."""

    epoch: int
    devices: tuple[int, ...]
    identity: JobIdentity


class Preloads:
    """The preloads of the jobs arriving on this node: started, taken by a restore, or dropped."""

    def __init__(
        self,
        daemon: Daemon,
        holdings: StoredHoldings,
        locks: Callable[[int], asyncio.Lock],
        free_devices: Callable[[int], list[int]],
        note: Callable[[str, str], None],
    ) -> None:
        self.daemon = daemon
        self.holdings = holdings
        self.locks = locks
        """The job's restore lock: a preload, a restore and a discard of one job never overlap."""
        self.free_devices = free_devices
        """The devices free for an arriving job: no job holds them, no other arriving job's preload."""
        self.note = note
        self.held: dict[int, Preloaded] = {}
        self.running: dict[int, asyncio.Future[None]] = {}
        daemon.reserved_devices = self.devices_held

    def devices_held(self, but: int | None = None) -> set[int]:
        """Devices holding preloaded state of arriving jobs (but `but`'s)."""
        return {device for job, held in self.held.items() if job != but for device in held.devices}

    def received(self, job_id: str, epoch: int, directory: Path) -> asyncio.Future[None] | None:
        """A transfer for (job, epoch) has all its chunks: preload, if it was the pre-copy; the
        preload under way for the job, if any."""
        number = int(job_id)
        if not self.daemon.config.move_preload or number in self.running:
            return self.running.get(number)
        held = self.held.get(number)
        if held is not None and held.epoch == epoch:
            return None
        task = asyncio.ensure_future(self._preload(job_id, epoch, directory))
        self.running[number] = task

        def done(finished: asyncio.Future[None]) -> None:
            if self.running.get(number) is finished:
                del self.running[number]
            if not finished.cancelled() and finished.exception() is not None:
                log.error("job %s: preload failed", job_id, exc_info=finished.exception())

        task.add_done_callback(done)
        return task

    async def _preload(self, job_id: str, epoch: int, directory: Path) -> None:
        """Start the job's servers on free devices and have them read the pre-copied records received
        in `directory`, while the epoch is still only prepared here (noted in the job's events)."""
        number = int(job_id)
        async with self.locks(number):
            holding = self.holdings.load(job_id)
            if holding is None or holding.epoch != epoch or holding.phase is not Phase.IN_PREPARED:
                return  # the restore began, or the epoch was given up
            found = await asyncio.to_thread(jobfiles.pre_copied, directory)
            if found is None:
                return
            await self._drop(number)
            free = self.free_devices(number)
            if len(free) < found.devices:
                self.note(
                    job_id, f"pre-copied device state not preloaded: {counted(len(free), 'device')} free"
                )
                return
            devices = tuple(free[: found.devices])
            identity = JobIdentity(found.uid, found.gid, tuple(user_groups(found.user, found.gid)))
            began = time.monotonic()
            devices_access = self.daemon.devices
            self.held[number] = Preloaded(epoch, devices, identity)  # reserved before any await
            try:
                await devices_access.admit(number, identity, devices)
                results = await devices_access.preload(number, devices, found.images)
            except (DeviceError, OSError) as error:
                await self._drop(number)
                self.note(job_id, f"pre-copied device state not preloaded: {error}")
                return
            for result in results:
                device = result.get("device")
                if result.get("preloaded_bytes"):
                    preloaded = human_bytes(int(result["preloaded_bytes"]))
                    self.note(
                        job_id,
                        f"preloaded {preloaded} of device state on device {device} in "
                        f"{float(result.get('seconds') or 0.0):.2f}s",
                    )
                else:
                    self.note(job_id, f"nothing preloaded on device {device}: {result.get('refused')}")
            log.info("job %s: preload took %.2fs", job_id, time.monotonic() - began)
            await faults.held_at(faults.PRELOADED)

    def take(self, job_id: int, epoch: int, needed: int) -> Preloaded | None:
        """The servers holding the epoch's preloaded state, for its restore, if they fit it (as many
        devices as it needs, still free): from now on they are the job's servers like any admitted
        ones. Servers that do not fit are stopped (None). The restore starts them afresh where the
        job's owner is not the one they run as, which drops what they preloaded."""
        held = self.held.pop(job_id, None)
        if held is None:
            return None
        free = set(self.free_devices(job_id))
        if held.epoch == epoch and len(held.devices) == needed and set(held.devices) <= free:
            return held
        self.daemon.devices.forget(job_id)
        self.daemon.request_schedule()
        return None

    async def drop(self, job_id: int, epoch: int | None = None) -> None:
        """Stop the job's preload servers (for `epoch`, or any), freeing what they preloaded (call it
        with the job's restore lock held, and only for a job that does not run here)."""
        held = self.held.get(job_id)
        if held is not None and epoch in (None, held.epoch):
            await self._drop(job_id)

    async def _drop(self, job_id: int) -> None:
        """Stop the servers holding the job's preloaded state, if it has any."""
        if self.held.pop(job_id, None) is not None:
            self.daemon.devices.forget(job_id)
            self.daemon.request_schedule()  # a local job may take its devices now
