"""Checkpoints of whole jobs: CRIU for the processes, the device proxies for device state.

`Checkpoints` is what the daemon needs: take a checkpoint of a running job (quiescing its
devices, dumping its tree, then releasing or resuming its devices), restore one (loading device
state and reconnecting the restored processes to their proxies), and say what a job has on disk.
`JobCheckpoints` does it with CRIU; `NoCheckpoints` stands in, with the reason, where CRIU
cannot work, so the daemon never branches on whether checkpoints exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from singularityd.checkpoint.errors import CheckpointError
from singularityd.checkpoint.manifest import IMAGES_DIR, MANIFEST_NAME, Manifest
from singularityd.checkpoint.precheck import tree_pids
from singularityd.checkpoint.service import Checkpointer, CheckpointResult
from singularityd.devices.access import DeviceAccess, DeviceError
from singularityd.units import human_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CriuStatus:
    """Whether checkpoints can work here, with the binary used or the reason they cannot."""

    path: str
    version: str
    unavailable_reason: str


@dataclass(frozen=True)
class CheckpointTarget:
    """A running job to checkpoint: its supervisor, owner, devices and append-only logs."""

    job_id: int
    pid: int
    uid: int
    gid: int
    devices: tuple[int, ...]
    rewind_paths: tuple[str, ...]


@dataclass(frozen=True)
class CheckpointTaken:
    """A complete checkpoint as the daemon reports it; `summary` is the text of its event."""

    seq: int
    created_at: float
    image_bytes: int
    pause_s: float
    summary: str


@dataclass(frozen=True)
class StoredCheckpoint:
    """One of a job's checkpoint folders: complete (with a readable manifest) or not.

    `pause_s` is how long taking it froze the job (0 when unknown or incomplete).
    """

    seq: int
    created_at: float
    image_bytes: int
    complete: bool
    pause_s: float = 0.0


@dataclass(frozen=True)
class Restoration:
    """A job's processes restored: the root's host PID, the checkpoint used, the newer ones skipped.

    `problem` says why the job cannot go on although its processes run (the device proxies did
    not take them back); empty when all is well.
    """

    pid: int
    seq: int
    skipped: tuple[tuple[int, str], ...] = ()
    problem: str = ""


def checkpoint_summary(result: CheckpointResult) -> str:
    """What an event says about a checkpoint: its number, size, the pause and pre-copy."""
    text = f"checkpoint {result.seq} ({human_bytes(result.image_bytes)}, paused {result.pause_s:.2f}s"
    if result.pre_dumps:
        text += f" after {len(result.pre_dumps)} pre-copy round(s)"
    if result.pruned:
        text += f"; removed older checkpoint(s) {','.join(str(s) for s in result.pruned)}"
    return text + ")"


class Checkpoints(Protocol):
    """What the daemon needs to checkpoint and restore jobs."""

    status: CriuStatus

    @property
    def available(self) -> bool:
        """Whether checkpoints can be taken here."""

    def has_checkpoint(self, job_id: int) -> bool:
        """Whether the job has a complete checkpoint (verified only when restoring)."""

    def usage(self, job_id: int) -> tuple[int, int]:
        """How many checkpoints the job has and the bytes they take on disk."""

    def listing(self, job_id: int) -> list[StoredCheckpoint]:
        """Each of the job's checkpoint folders, oldest first."""

    def latest(self, job_id: int) -> StoredCheckpoint | None:
        """The job's newest complete checkpoint, or None when it has none."""

    async def take(self, target: CheckpointTarget, *, stop: bool, reason: str) -> CheckpointTaken:
        """Checkpoint the job (stopping it when `stop`); CheckpointError says why it failed."""

    async def restore(self, job_id: int, devices: tuple[int, ...]) -> Restoration:
        """Restore the job onto these devices; CheckpointError says why it could not be."""

    async def resume_parked(self, job_id: int, devices: tuple[int, ...]) -> None:
        """Let go a job a killed daemon may have left parked in its proxies mid-checkpoint."""


class NoCheckpoints:
    """Checkpoints cannot work here; every attempt fails with the reason."""

    def __init__(self, status: CriuStatus) -> None:
        self.status = status

    @property
    def available(self) -> bool:
        """Never."""
        return False

    def has_checkpoint(self, job_id: int) -> bool:
        """No checkpoint can be used here."""
        return False

    def usage(self, job_id: int) -> tuple[int, int]:
        """Nothing is counted."""
        return 0, 0

    def listing(self, job_id: int) -> list[StoredCheckpoint]:
        """Nothing is listed."""
        return []

    def latest(self, job_id: int) -> StoredCheckpoint | None:
        """There is none."""
        return None

    async def take(self, target: CheckpointTarget, *, stop: bool, reason: str) -> CheckpointTaken:
        """Always fails, saying why."""
        raise CheckpointError(f"checkpoints are unavailable here: {self.status.unavailable_reason}")

    async def restore(self, job_id: int, devices: tuple[int, ...]) -> Restoration:
        """Always fails, saying why."""
        raise CheckpointError(f"checkpoints are unavailable here: {self.status.unavailable_reason}")

    async def resume_parked(self, job_id: int, devices: tuple[int, ...]) -> None:
        """Nothing was parked by a checkpoint."""


class JobCheckpoints:
    """Checkpoints with CRIU, coordinated with the job's devices.

    Only the daemon writes checkpoints, so a job's disk usage is computed once and kept until its
    next checkpoint, and a complete checkpoint's manifest (which never changes) is read once:
    listing many jobs, each with its newest checkpoint, does not walk their image folders.
    """

    def __init__(self, checkpointer: Checkpointer, devices: DeviceAccess, status: CriuStatus) -> None:
        self.checkpointer = checkpointer
        self.images = checkpointer.store
        self.devices = devices
        self.status = status
        self._usage: dict[int, tuple[int, int]] = {}
        self._manifests: dict[int, dict[int, Manifest]] = {}

    @property
    def available(self) -> bool:
        """Always: CRIU was found and works."""
        return True

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
        return StoredCheckpoint(seq, manifest.created_at, manifest.total_bytes, True, manifest.pause_s)

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

    def _forget_cached(self, job_id: int) -> None:
        """Drop what is kept about the job's checkpoints: a new one is being taken, old ones pruned."""
        self._usage.pop(job_id, None)
        self._manifests.pop(job_id, None)

    async def take(self, target: CheckpointTarget, *, stop: bool, reason: str) -> CheckpointTaken:
        """Quiesce the job's devices and save their state, dump the tree, then release or resume."""
        job_id, devices = target.job_id, target.devices
        quiesced = False
        self._forget_cached(job_id)
        try:
            connections = await asyncio.to_thread(self.devices.connections, tree_pids(target.pid))

            async def save_device_state(images: Path) -> None:
                nonlocal quiesced
                if connections:
                    quiesced = True
                    await self.devices.quiesce_and_save(job_id, devices, images)

            result = await self.checkpointer.checkpoint(
                str(job_id),
                target.pid,
                owner_uid=target.uid,
                owner_gid=target.gid,
                leave_running=not stop,
                rewind_paths=target.rewind_paths,
                external_unix_inodes=[c.inode for c in connections],
                before_final_dump=save_device_state,
                extra={
                    "reason": reason,
                    "devices": list(devices),
                    "proxy_connections": [c.as_dict() for c in connections],
                },
            )
        except (CheckpointError, DeviceError, OSError) as error:
            if quiesced:
                with contextlib.suppress(DeviceError):
                    await self.devices.resume(job_id, devices)
            raise error if isinstance(error, CheckpointError) else CheckpointError(str(error)) from None
        finally:
            self._forget_cached(job_id)
        if quiesced:
            finish = self.devices.release if stop else self.devices.resume
            try:
                await finish(job_id, devices)
            except DeviceError as error:
                log.error("job %d: proxy %s after the checkpoint failed: %s", job_id, finish.__name__, error)
        return CheckpointTaken(
            result.seq,
            result.manifest.created_at,
            result.image_bytes,
            result.pause_s,
            checkpoint_summary(result),
        )

    async def restore(self, job_id: int, devices: tuple[int, ...]) -> Restoration:
        """Restore the newest good checkpoint, reconnecting the processes to their devices."""
        opened: list[socket.socket] = []

        def reconnect(manifest: Manifest) -> dict[str, int]:
            connections = manifest.extra.get("proxy_connections") or []
            if not connections:
                return {}
            folder = self.images.checkpoint_dir(str(job_id), manifest.seq) / IMAGES_DIR
            inherit, sockets = self.devices.reconnect(job_id, devices, folder, connections)
            opened.extend(sockets)
            return inherit

        try:
            result = await self.checkpointer.restore_latest(str(job_id), inherit_fds=reconnect)
        except (CheckpointError, DeviceError, OSError) as error:
            with contextlib.suppress(DeviceError):
                await self.devices.release(job_id, devices)
            raise error if isinstance(error, CheckpointError) else CheckpointError(str(error)) from None
        finally:
            for connection in opened:
                connection.close()
        problem = ""
        if opened:
            try:
                await self.devices.resume(job_id, devices)
            except DeviceError as error:
                problem = f"the device proxies did not resume the job: {error}"
        skipped = tuple((s.seq, s.reason) for s in result.skipped)
        return Restoration(result.pid, result.seq, skipped, problem)

    async def resume_parked(self, job_id: int, devices: tuple[int, ...]) -> None:
        """Let go a job a killed daemon may have left parked in its proxies mid-checkpoint."""
        with contextlib.suppress(DeviceError):
            await self.devices.resume(job_id, devices)
