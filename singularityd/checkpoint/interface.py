"""What the daemon needs of checkpoints, and the records they give back.

`Checkpoints` is what the daemon calls to take, restore and list a job's checkpoints;
`coordinator.JobCheckpoints` does it with CRIU and the device proxies, and `NoCheckpoints` stands
in, with the reason, where CRIU cannot work, so the daemon never branches on whether checkpoints
exist.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from singularityd.checkpoint.errors import CheckpointError
from singularityd.checkpoint.pause import Downtime, Pause, RestoreParts
from singularityd.checkpoint.restoring import KnownDigests
from singularityd.devices.proxy_servers import JobIdentity

BeforePause = Callable[[Path], Awaitable[None]]
"""Awaited with a checkpoint's images folder once its device state is pre-copied, before the pause."""


@dataclass(frozen=True)
class PauseHooks:
    """What a caller runs with a checkpoint's images folder: `before_pause`, awaited once the
    device state is pre-copied, the job still running (a move sends that part then); `once_dumped`,
    called as soon as CRIU has returned from a stopping dump, while the manifest is still being
    hashed (a move begins its process images' changes then); it must not block."""

    before_pause: BeforePause | None = None
    once_dumped: Callable[[Path], None] | None = None


@dataclass(frozen=True)
class CriuStatus:
    """Whether checkpoints can work here, with the binary used or the reason they cannot."""

    path: str
    version: str
    unavailable_reason: str
    restore_guard_problem: str = ""
    """Why CRIU restores other users' jobs without the restore guard (checkpoint.restore_guard)."""


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
    """A complete checkpoint as the daemon reports it; `summary` is the text of its event.

    `pause_s` is what the job lost (see checkpoint/pause.py), `complete_s` the time from the start
    of the pause until the manifest was written."""

    seq: int
    created_at: float
    image_bytes: int
    pause_s: float
    summary: str
    complete_s: float = 0.0
    stopped: bool = False
    precopied_bytes: int = 0
    paused_bytes: int = 0


@dataclass(frozen=True)
class StoredCheckpoint:
    """One of a job's checkpoint folders: complete (with a readable manifest) or not, and its pause.

    `pause` is what taking it cost the job (None when incomplete or taken before pauses were
    recorded: then `frozen_s`, CRIU's freeze, is all that is known).
    """

    seq: int
    created_at: float
    image_bytes: int
    complete: bool
    pause: Pause | None = None
    frozen_s: float = 0.0
    stop: Mapping[str, Any] | None = None
    """For a checkpoint that stopped the job: what for (core.lost_processes.StopPurpose's form)."""

    @property
    def pause_s(self) -> float:
        """How long the job could not make progress for it (0 when unknown or incomplete)."""
        return self.pause.seconds if self.pause else self.frozen_s

    @property
    def complete_s(self) -> float:
        """From the start of its pause until its manifest was written (0 when unknown)."""
        return max(0.0, self.created_at - self.pause.began_at) if self.pause else 0.0


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
    downtime: Downtime | None = None
    parts: RestoreParts | None = None


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

    async def take(
        self,
        target: CheckpointTarget,
        *,
        stop: bool,
        reason: str,
        hooks: PauseHooks | None = None,
        purpose: Mapping[str, Any] | None = None,
    ) -> CheckpointTaken:
        """Checkpoint the job (stopping it when `stop`); CheckpointError says why it failed.

        `hooks` are run with the images folder (see PauseHooks). `purpose` (small JSON: why a
        stopping dump stops the job) is kept with the dump's intent and manifest, so a daemon
        killed before it stored the job's new state finds it (core.lost_processes)."""

    async def restore(
        self,
        job_id: int,
        devices: tuple[int, ...],
        logical: int | None = None,
        known_digests: KnownDigests | None = None,
        user: JobIdentity | None = None,
    ) -> Restoration:
        """Restore `user`'s job onto these devices, seen as `logical` ones; CheckpointError says why
        it could not be. `known_digests`: files hashed as they arrived (see
        Checkpointer.restore_latest)."""

    async def resume_parked(self, job_id: int, devices: tuple[int, ...]) -> None:
        """Let go a job a killed daemon may have left parked in its proxies mid-checkpoint."""

    def discard(self, job_id: int, shared_memory: bool = False) -> int:
        """Remove every checkpoint of a job that has ended for good (with `shared_memory`, the
        /dev/shm files they carried); the bytes they took on disk."""

    async def settle_interrupted(self, job_id: int) -> str:
        """Record or remove a dump that stops the job, cut short by the daemon's death (see
        checkpoint.interrupted); what was done, '' when there was none."""

    def close(self) -> None:
        """Let go of what checkpoints hold while the daemon runs (the daemon stops)."""


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

    async def take(
        self,
        target: CheckpointTarget,
        *,
        stop: bool,
        reason: str,
        hooks: PauseHooks | None = None,
        purpose: Mapping[str, Any] | None = None,
    ) -> CheckpointTaken:
        """Always fails, saying why."""
        raise CheckpointError(f"checkpoints are unavailable here: {self.status.unavailable_reason}")

    async def restore(
        self,
        job_id: int,
        devices: tuple[int, ...],
        logical: int | None = None,
        known_digests: KnownDigests | None = None,
        user: JobIdentity | None = None,
    ) -> Restoration:
        """Always fails, saying why."""
        raise CheckpointError(f"checkpoints are unavailable here: {self.status.unavailable_reason}")

    async def resume_parked(self, job_id: int, devices: tuple[int, ...]) -> None:
        """Nothing was parked by a checkpoint."""

    def discard(self, job_id: int, shared_memory: bool = False) -> int:
        """Nothing was written."""
        return 0

    async def settle_interrupted(self, job_id: int) -> str:
        """No dump was ever started here."""
        return ""

    def close(self) -> None:
        """Nothing is held."""
