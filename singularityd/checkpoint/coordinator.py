"""Checkpoints of whole jobs: CRIU for the processes, the device proxies for device state.

`JobCheckpoints` is the daemon's `Checkpoints` (interface.py) where CRIU works: it takes a
checkpoint of a running job (quiescing its devices, dumping its tree, then releasing or resuming
its devices), restores one (loading device state and reconnecting the restored processes to
their proxies), and says what a job has on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from singularityd import faults
from singularityd.checkpoint.criu import DumpStats
from singularityd.checkpoint.errors import CheckpointError, DeviceConnectedMeanwhile, JobEnded
from singularityd.checkpoint.hashing import PrefixHash, hash_prefixes
from singularityd.checkpoint.interface import (
    CheckpointTaken,
    CheckpointTarget,
    CriuStatus,
    PauseHooks,
    Restoration,
    StoredCheckpoint,
)
from singularityd.checkpoint.interrupted import settle_interrupted
from singularityd.checkpoint.manifest import IMAGES_DIR, MANIFEST_NAME, Manifest
from singularityd.checkpoint.pause import (
    DeviceSaveFigures,
    Pause,
    RestoreParts,
    downtime,
    measure_pause,
    pause_summary,
)
from singularityd.checkpoint.precheck import tree_pids
from singularityd.checkpoint.restoring import KnownDigests
from singularityd.checkpoint.service import Checkpointer, CheckpointResult
from singularityd.checkpoint.shm import release
from singularityd.devices.access import (
    DeviceAccess,
    DeviceError,
    DeviceStateSave,
    JobGoneFromDevice,
    NoDeviceState,
    PreCopy,
)
from singularityd.devices.proxies import ProxyConnection, Reconnection
from singularityd.devices.proxy_servers import JobIdentity
from singularityd.devices.splicing import SavedLayout
from singularityd.units import human_bytes

log = logging.getLogger(__name__)

CONNECTION_RACE_ATTEMPTS = 3
"""How often a checkpoint is tried while the job's processes keep connecting to devices during it."""


def checkpoint_summary(result: CheckpointResult, pause: Pause, complete_s: float) -> str:
    """What an event says about a checkpoint: its number, size, the pause and pre-copy."""
    text = f"checkpoint {result.seq} ({human_bytes(result.image_bytes)}, {pause_summary(pause, complete_s)}"
    if result.staged:
        text += f"; process images staged in memory, on disk {result.move_s:.2f}s after"
    elif result.staging_note:
        text += f"; {result.staging_note}"
    if result.pre_dumps:
        text += f"; after {len(result.pre_dumps)} CRIU pre-dump(s)"
    if result.pruned:
        text += f"; removed older checkpoint(s) {','.join(str(s) for s in result.pruned)}"
    return text + ")"


def manifest_pause(manifest: Manifest) -> Pause | None:
    """The pause a checkpoint's manifest records (None for checkpoints that predate it)."""
    raw = manifest.stats.get("pause")
    return Pause.from_dict(raw) if isinstance(raw, Mapping) else None


class JobCheckpoints:
    """Checkpoints with CRIU, coordinated with the job's devices.

    Only the daemon writes checkpoints, so a job's disk usage is computed once and kept until its
    next checkpoint, and a complete checkpoint's manifest (which never changes) is read once:
    listing many jobs, each with its newest checkpoint, does not walk their image folders.
    """

    def __init__(
        self,
        checkpointer: Checkpointer,
        devices: DeviceAccess,
        status: CriuStatus,
        pre_copy: PreCopy | None = None,
    ) -> None:
        self.checkpointer = checkpointer
        self.images = checkpointer.store
        self.devices = devices
        self.status = status
        self.pre_copy = pre_copy or PreCopy()
        """How much device state the proxies copy while the job runs (live: set on reload)."""
        self._usage: dict[int, tuple[int, int]] = {}
        self._manifests: dict[int, dict[int, Manifest]] = {}

    @property
    def available(self) -> bool:
        """Always: CRIU was found and works."""
        return True

    def close(self) -> None:
        """Remove the staging folder of process images, if there is one (the daemon stops)."""
        self.checkpointer.close()

    def has_checkpoint(self, job_id: int) -> bool:
        """Whether the job has at least one complete checkpoint (verified only when restoring)."""
        return any(
            (self.images.checkpoint_dir(str(job_id), seq) / MANIFEST_NAME).exists()
            for seq in self.images.seqs(str(job_id))
        )

    def usage(self, job_id: int) -> tuple[int, int]:
        """How many checkpoints the job has and the bytes they take on disk."""
        if job_id not in self._usage:
            usage = self.images.usage(str(job_id))
            self._usage[job_id] = (usage.checkpoints, usage.bytes_on_disk)
        return self._usage[job_id]

    def _manifest(self, job_id: int, seq: int) -> Manifest | None:
        """The manifest of one of the job's checkpoints (read once), or None when incomplete."""
        known = self._manifests.setdefault(job_id, {})
        if seq not in known:
            try:
                known[seq] = self.images.read_manifest(str(job_id), seq)
            except (CheckpointError, OSError, ValueError):
                return None
        return known[seq]

    def _stored(self, job_id: int, seq: int) -> StoredCheckpoint:
        """One checkpoint folder as listed: with its manifest's facts when complete."""
        manifest = self._manifest(job_id, seq)
        if manifest is None:
            return StoredCheckpoint(seq, 0.0, 0, False)
        stop = manifest.extra.get("stop")
        return StoredCheckpoint(
            seq,
            manifest.created_at,
            manifest.total_bytes,
            True,
            manifest_pause(manifest),
            manifest.pause_s,
            stop if isinstance(stop, Mapping) else None,
        )

    def listing(self, job_id: int) -> list[StoredCheckpoint]:
        """Each of the job's checkpoint folders, oldest first."""
        return [self._stored(job_id, seq) for seq in self.images.seqs(str(job_id))]

    def latest(self, job_id: int) -> StoredCheckpoint | None:
        """The job's newest complete checkpoint, or None (no folder is read for a job without any)."""
        if not self.usage(job_id)[0]:
            return None
        for seq in reversed(self.images.seqs(str(job_id))):
            stored = self._stored(job_id, seq)
            if stored.complete:
                return stored
        return None

    def discard(self, job_id: int, shared_memory: bool = False) -> int:
        """Remove every checkpoint of a job that has ended for good (with `shared_memory`, the
        /dev/shm files they carried: the job has no processes left to remove them); the bytes
        they took on disk."""
        if shared_memory:
            folders = [
                self.images.checkpoint_dir(str(job_id), seq) / IMAGES_DIR
                for seq in self.images.seqs(str(job_id))
            ]
            for name in release(folders):
                log.info("job %d: removed /dev/shm/%s, which its checkpoints carried", job_id, name)
        freed = self.images.usage(str(job_id)).bytes_on_disk
        self.images.remove_checkpoints(str(job_id))
        self._forget_cached(job_id)
        return freed

    def _forget_cached(self, job_id: int) -> None:
        """Drop what is kept about the job's checkpoints: a new one is being taken, old ones pruned."""
        self._usage.pop(job_id, None)
        self._manifests.pop(job_id, None)

    async def take(
        self,
        target: CheckpointTarget,
        *,
        stop: bool,
        reason: str,
        hooks: PauseHooks | None = None,
        purpose: Mapping[str, Any] | None = None,
    ) -> CheckpointTaken:
        """Checkpoint the job (see `_take_once`), again when it failed because a process of the job
        connected to a device meanwhile (a rank's first use of a device, a process it started): the
        connections are found before the dump, and CRIU refuses one it was not told of, as a server
        refuses to save a session that connected after the job parked. A move's checkpoint, whose
        hooks have run, is not taken again."""
        attempts = 1 if hooks is not None else CONNECTION_RACE_ATTEMPTS
        for attempt in range(1, attempts + 1):
            try:
                return await self._take_once(target, stop=stop, reason=reason, hooks=hooks, purpose=purpose)
            except DeviceConnectedMeanwhile as error:
                if attempt == attempts:
                    raise
                log.info("job %d: %s; taking it again", target.job_id, error)
        raise AssertionError("unreachable")

    async def _take_once(
        self,
        target: CheckpointTarget,
        *,
        stop: bool,
        reason: str,
        hooks: PauseHooks | None,
        purpose: Mapping[str, Any] | None,
    ) -> CheckpointTaken:
        """Checkpoint the job with the shortest pause its devices allow, then release or resume them.

        While the job runs, its proxies pre-copy its device state. The pause begins when they park
        it. In place (`stop` false), what changed is copied in memory while CRIU dumps the
        processes, the job runs again as soon as both are done, and the device state is written
        and everything hashed after. For a preemption the device state is written before CRIU
        stops the processes, so that a failure leaves the job running.
        """
        job_id, devices = target.job_id, target.devices
        parked = False
        saving: DeviceStateSave = NoDeviceState()
        capturing: asyncio.Future[None] | None = None
        releasing: asyncio.Future[None] | None = None
        self._forget_cached(job_id)

        async def before_dump(images: Path) -> None:
            nonlocal parked, capturing, saving
            if connections:
                saving = self.devices.device_save(job_id, devices, images, self.pre_copy)
            await saving.prepare()
            if stop:  # what was pre-copied is only appended to from now on: hash it while the job runs
                prefixes.update(await asyncio.to_thread(hash_prefixes, images, images.parent))
            dumped_into.append(images)
            if hooks is not None and hooks.before_pause is not None:
                await hooks.before_pause(images)
            parked = True
            await saving.park()
            marks["parked"] = time.monotonic()
            if stop:
                await saving.capture(copy=False)
                figures.append(await saving.finish())
            else:
                capturing = asyncio.ensure_future(saving.capture(copy=True))  # beside CRIU's dump

        async def after_dump(dump: DumpStats) -> Mapping[str, Any]:
            nonlocal parked, releasing
            returned = time.monotonic()
            if stop and hooks is not None and hooks.once_dumped is not None and dumped_into:
                hooks.once_dumped(dumped_into[-1])
            if capturing is not None:
                await capturing
            if parked and not stop:
                await self.devices.resume(job_id, devices)
                parked = False
            try:
                stamps = await saving.stamps()
            except DeviceError as error:  # the figures suffer, not the checkpoint
                log.warning("job %d: no pause timestamps from its proxies: %s", job_id, error)
                stamps = None
            if not stop:
                figures.append(await saving.finish())
            pause = measure_pause(
                parked_at=stamps.parked_at if stamps else (),
                resumed_at=stamps.resumed_at if stamps else (),
                criu_returned_at=returned,
                frozen_s=dump.pause_s,
                stopped=stop,
                device=figures[-1] if figures else DeviceSaveFigures(),
            )
            pauses.append(pause)
            log.info(
                "job %d: paused %.3fs: parked %.3fs before CRIU returned (frozen %.3fs), running %.3fs after",
                job_id,
                pause.seconds,
                returned - marks.get("parked", returned),
                dump.pause_s,
                max(stamps.resumed_at) - returned if stamps and stamps.resumed_at else 0.0,
            )
            if stop and connections:  # the processes are gone and their device state is saved
                releasing = asyncio.ensure_future(self.devices.release(job_id, devices))
            return {"pause": pause.as_dict()}

        figures: list[DeviceSaveFigures] = []
        dumped_into: list[Path] = []
        prefixes: dict[str, PrefixHash] = {}
        pauses: list[Pause] = []
        marks: dict[str, float] = {}
        connections = []
        try:
            connections = await self._connections_of(target.pid)
            await faults.held_at(faults.CONNECTIONS_FOUND)
            result = await self.checkpointer.checkpoint(
                str(job_id),
                target.pid,
                owner_uid=target.uid,
                owner_gid=target.gid,
                leave_running=not stop,
                rewind_paths=target.rewind_paths,
                external_unix_inodes=[c.inode for c in connections],
                before_final_dump=before_dump,
                after_final_dump=after_dump,
                prefixes=prefixes,
                extra={
                    "reason": reason,
                    "devices": list(devices),
                    "proxy_connections": [c.as_dict() for c in connections],
                    **({"stop": dict(purpose)} if stop and purpose else {}),
                },
            )
        except (CheckpointError, DeviceError, OSError) as error:
            for started in (capturing, releasing):
                if started is not None:
                    with contextlib.suppress(Exception):
                        await started
            with contextlib.suppress(DeviceError):
                await saving.abort()
            if parked:
                with contextlib.suppress(DeviceError):
                    await self.devices.resume(job_id, devices)
            if isinstance(error, JobGoneFromDevice):
                raise JobEnded(f"job {job_id} ended while it was being checkpointed") from None
            if await self._connected_since(target.pid, connections):  # CRIU or a server refused it
                raise DeviceConnectedMeanwhile(
                    f"job {job_id} connected to a device while it was being checkpointed; checkpoint it again"
                ) from None
            raise error if isinstance(error, CheckpointError) else CheckpointError(str(error)) from None
        finally:
            self._forget_cached(job_id)
        if releasing is not None:  # begun once CRIU was done, beside the manifest's hashing
            try:
                await releasing
            except DeviceError as error:
                log.error("job %d: releasing its devices after the checkpoint failed: %s", job_id, error)
        pause = pauses[0]
        complete_s = max(0.0, result.manifest.created_at - pause.began_at)  # as StoredCheckpoint says
        return CheckpointTaken(
            result.seq,
            result.manifest.created_at,
            result.image_bytes,
            pause.seconds,
            checkpoint_summary(result, pause, complete_s),
            complete_s=complete_s,
            stopped=stop,
            precopied_bytes=pause.device.reused_bytes,
            paused_bytes=pause.device.paused_copied_bytes + (pause.device.written_after_bytes if stop else 0),
        )

    async def _connected_since(self, pid: int, found: Sequence[ProxyConnection]) -> bool:
        """Whether the job's processes now hold a device connection that was not `found`."""
        known = {c.inode for c in found}
        try:
            now = await self._connections_of(pid)
        except OSError:
            return False
        return any(c.inode not in known for c in now)

    async def _connections_of(self, pid: int) -> list[ProxyConnection]:
        """The device connections held by the process tree of `pid` (found in a thread)."""
        return await asyncio.to_thread(lambda: self.devices.connections(tree_pids(pid)))

    async def dump_in_place(self, job_id: int, pid: int, folder: Path, log_file: Path) -> DumpStats:
        """Dump the running job's processes into `folder`, outside its checkpoints (a move's base),
        its proxy connections kept external as in a checkpoint; CheckpointError or OSError say why not."""
        connections = await self._connections_of(pid)
        return await self.checkpointer.dump_in_place(
            str(job_id), pid, folder, external_unix_inodes=[c.inode for c in connections], log_file=log_file
        )

    async def restore(
        self,
        job_id: int,
        devices: tuple[int, ...],
        logical: int | None = None,
        known_digests: KnownDigests | None = None,
        user: JobIdentity | None = None,
    ) -> Restoration:
        """Restore the newest good checkpoint of `user`'s job, reconnecting the processes to their
        devices (the job sees `logical` devices; its checkpoint may have held another number of
        them: a resize)."""
        began = time.monotonic()
        opened: list[socket.socket] = []
        loading: list[float] = []
        loaded: list[Reconnection] = []

        def reconnect(manifest: Manifest) -> dict[str, int]:
            connections = manifest.extra.get("proxy_connections") or []
            if not connections:
                return {}
            folder = self.images.checkpoint_dir(str(job_id), manifest.seq) / IMAGES_DIR
            held = len(manifest.extra.get("devices") or devices)
            layout = SavedLayout(logical or max(held, len(devices)), held)
            loading_began = time.monotonic()
            reconnection = self.devices.reconnect(job_id, devices, folder, connections, layout)
            loading.append(time.monotonic() - loading_began)
            loaded.append(reconnection)
            opened.extend(reconnection.sockets)
            return reconnection.inherit

        try:
            result = await self.checkpointer.restore_latest(
                str(job_id), inherit_fds=reconnect, known_digests=known_digests, user=user
            )
        except (CheckpointError, DeviceError, OSError) as error:
            with contextlib.suppress(DeviceError):
                await self.devices.release(job_id, devices)
            raise error if isinstance(error, CheckpointError) else CheckpointError(str(error)) from None
        finally:
            for connection in opened:
                connection.close()
        problem = ""
        resume_began = time.monotonic()
        if loaded:  # the servers hold the job's sessions parked, connected or not
            try:
                await self.devices.resume(job_id, devices)
            except DeviceError as error:
                problem = f"the device proxies did not resume the job: {error}"
        down = downtime(began, time.monotonic(), manifest_pause(result.manifest))
        skipped = tuple((s.seq, s.reason) for s in result.skipped)
        parts = RestoreParts(
            result.verify_s,
            result.hashed_bytes,
            sum(loading),
            result.outcome.wall_s,
            time.monotonic() - resume_began,
            sum(each.file_bytes for each in loaded),
            sum(each.preloaded_bytes for each in loaded),
        )
        return Restoration(result.pid, result.seq, skipped, problem, down, parts)

    async def resume_parked(self, job_id: int, devices: tuple[int, ...]) -> None:
        """Let go a job a killed daemon may have left parked in its proxies mid-checkpoint."""
        with contextlib.suppress(DeviceError):
            await self.devices.resume(job_id, devices)

    async def settle_interrupted(self, job_id: int) -> str:
        """Record or remove a dump that stops the job, cut short by the daemon's death."""
        self._forget_cached(job_id)
        try:
            return await settle_interrupted(self.checkpointer, str(job_id))
        finally:
            self._forget_cached(job_id)
