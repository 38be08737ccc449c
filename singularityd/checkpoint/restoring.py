"""Restorer: the restoring half of what the daemon calls for checkpoints (service.Checkpointer
adds the dumping half).

On restore it takes the job's newest checkpoint that verifies against its manifest, saying why
each newer one was passed over, cuts the files recorded at the dump back to their sizes then, and
has CRIU restore the tree with the replacement fds of its external sockets, under the restore
guard for another user's job (checkpoint.restore_guard), stopped until the files CRIU reopened
for it are found to be its user's to hold (checkpoint.reopened). All methods are
coroutines; file hashing and other blocking work run in threads.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from singularityd import faults
from singularityd.checkpoint.criu import LEAVE_STOPPED, Criu, RestoreOutcome, run_to_completion
from singularityd.checkpoint.errors import CheckpointError, NoValidCheckpoint
from singularityd.checkpoint.image_files import stopped_at_dump
from singularityd.checkpoint.manifest import IMAGES_DIR, Manifest, Skipped, Verdict
from singularityd.checkpoint.precheck import signal_tree
from singularityd.checkpoint.reopened import named_path_problems, reopened_problems
from singularityd.checkpoint.shm import write_back
from singularityd.checkpoint.store import ImageStore, rewind_files
from singularityd.units import first_few

if TYPE_CHECKING:
    from singularityd.devices.proxy_servers import JobIdentity


def continue_as_dumped(pid: int, images: Path) -> None:
    """Let run the tree under `pid` that a restore from `images` left stopped, but for the
    processes that were stopped when dumped (their user stopped them)."""
    signal_tree(pid, signal.SIGCONT, sparing=stopped_at_dump(images))


InheritFds = Mapping[str, int] | Callable[[Manifest], Mapping[str, int]]


@dataclass(frozen=True)
class KnownDigests:
    """What is known here of checkpoint `seq`'s files without reading them: the sha256 of those
    hashed as they arrived (by path in the checkpoint), and the files whose checksums the caller
    checks itself, while CRIU restores, before it lets the processes run (only for a restore that
    leaves them stopped)."""

    seq: int
    digests: Mapping[str, str]
    checked_by_caller: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RestoreResult:
    """A restored job: the host PID of its root, the checkpoint used and the ones passed over."""

    job_id: str
    seq: int
    pid: int
    manifest: Manifest
    outcome: RestoreOutcome
    skipped: tuple[Skipped, ...]
    rewound: Mapping[str, int] = field(default_factory=dict)
    verify_s: float = 0.0
    hashed_bytes: int = 0
    """Bytes read and hashed to check the checkpoint against its manifest."""


class Restorer:
    """Restores jobs from their checkpoints in the image store; serialises operations per job
    through the store's lock."""

    def __init__(self, criu: Criu, store: ImageStore) -> None:
        self.criu = criu
        self.store = store

    @property
    def restores_stopped(self) -> bool:
        """Whether restored processes are left stopped (CRIU --leave-stopped) for the caller to let run."""
        return LEAVE_STOPPED in self.criu.options.extra_restore_args

    async def restore_latest(
        self,
        job_id: str,
        *,
        inherit_fds: InheritFds | None = None,
        rewind: bool = True,
        deep_verify: bool = True,
        known_digests: KnownDigests | None = None,
        user: JobIdentity | None = None,
    ) -> RestoreResult:
        """Restore the job of `user` from its newest checkpoint that verifies.

        Each newer checkpoint that fails verification is skipped and reported in the result (the
        daemon logs these as events); NoValidCheckpoint is raised when none verifies. A CRIU
        failure on a good checkpoint raises CriuError without trying older ones (going back in
        time silently would be wrong). With `rewind`, the files recorded at the dump are cut back
        to their sizes then. `inherit_fds` (or a function of the manifest returning it) gives the
        replacement fds for the external sockets named in the manifest. `known_digests` gives, by
        checkpoint, the sha256 of files hashed as they arrived here, so they are not read again.
        """
        with self.store.locked(job_id):
            skipped: list[Skipped] = self.store.vanished(job_id)
            for seq in reversed(self.store.seqs(job_id)):
                known = known_digests if known_digests is not None and known_digests.seq == seq else None
                attempt = self._try_restore(
                    job_id, seq, inherit_fds, rewind, deep_verify, tuple(skipped), known, user
                )
                result = await run_to_completion(attempt)
                if isinstance(result, RestoreResult):
                    return result
                skipped.append(Skipped(seq, result.reason))
        reasons = "; ".join(f"{s.seq}: {s.reason}" for s in skipped) or "it has none"
        raise NoValidCheckpoint(f"job {job_id} has no valid checkpoint ({reasons})")

    async def restore(
        self,
        job_id: str,
        seq: int,
        *,
        inherit_fds: InheritFds | None = None,
        rewind: bool = True,
        deep_verify: bool = True,
        user: JobIdentity | None = None,
    ) -> RestoreResult:
        """Restore the job of `user` from checkpoint `seq`, which must verify."""
        with self.store.locked(job_id):
            result = await run_to_completion(
                self._try_restore(job_id, seq, inherit_fds, rewind, deep_verify, (), None, user)
            )
        if isinstance(result, RestoreResult):
            return result
        raise NoValidCheckpoint(f"checkpoint {seq} of job {job_id} is not usable: {result.reason}")

    async def _try_restore(
        self,
        job_id: str,
        seq: int,
        inherit_fds: InheritFds | None,
        rewind: bool,
        deep_verify: bool,
        skipped: tuple[Skipped, ...],
        known: KnownDigests | None = None,
        user: JobIdentity | None = None,
    ) -> RestoreResult | Verdict:
        if known is not None and known.checked_by_caller and not self.restores_stopped:
            raise ValueError("only a restore leaving the processes stopped leaves checksums to its caller")
        with self.store.sealed(job_id, seq) as path:
            t0 = time.monotonic()
            verdict = await asyncio.to_thread(
                self.store.verify,
                job_id,
                seq,
                deep=deep_verify,
                known=None if known is None else known.digests,
                checked_later=() if known is None else known.checked_by_caller,
            )
            verify_s = time.monotonic() - t0
            if not verdict.ok:
                return verdict
            manifest = await asyncio.to_thread(self.store.read_manifest, job_id, seq)
            if callable(inherit_fds):
                fds = dict(await asyncio.to_thread(inherit_fds, manifest))
            else:
                fds = dict(inherit_fds or {})
            # Under the guard CRIU makes nothing by name as root, so no link on the way can misdirect it.
            guarded = self.criu.guards(user)
            links = [] if guarded else await asyncio.to_thread(named_path_problems, path / IMAGES_DIR)
            if links:
                raise CheckpointError(
                    "restore refused, the checkpoint is kept: CRIU would make again by path, as root, "
                    f"{first_few(links)}; put back what was replaced on those paths since the checkpoint, "
                    "then resume again"
                )
            await faults.held_at(faults.RESTORE_CHECKED)
            rewound = rewind_files(manifest.rewind_sizes) if rewind else {}
            await asyncio.to_thread(write_back, path / IMAGES_DIR)
            logs = self.store.logs_dir(job_id)
            stamp = time.strftime("%Y%m%dT%H%M%S")
            outcome = await self.criu.restore(
                path / IMAGES_DIR,
                log_file=logs / f"restore-{seq:08d}-{stamp}.log",
                pidfile=logs / f"restore-{seq:08d}.pid",
                inherit_fds=fds,
                external_mounts=manifest.external_mounts,
                mount_yard=None if manifest.external_mounts is None else logs / "mount-yard",
                user=user,
            )
            await self._let_run_if_allowed(outcome.pid, path / IMAGES_DIR)
        return RestoreResult(
            job_id=job_id,
            seq=seq,
            pid=outcome.pid,
            manifest=manifest,
            outcome=outcome,
            skipped=skipped,
            rewound=rewound,
            verify_s=verify_s,
            hashed_bytes=verdict.hashed_bytes,
        )

    async def _let_run_if_allowed(self, pid: int, images: Path) -> None:
        """Check what CRIU reopened for the stopped tree under `pid` (see checkpoint.reopened); kill
        the tree and raise CheckpointError if a process may not keep it, else let it run as it was
        dumped from `images` (unless the caller asked for it stopped)."""
        problems = await asyncio.to_thread(reopened_problems, pid)
        if problems:
            await asyncio.to_thread(signal_tree, pid, signal.SIGKILL)
            raise CheckpointError(
                "restore refused, the checkpoint is kept: CRIU reopened by path files that the job's "
                f"user may not open now ({first_few(problems)}); put back what was moved or replaced on "
                "those paths since the checkpoint, then resume again"
            )
        if not self.restores_stopped:
            await asyncio.to_thread(continue_as_dumped, pid, images)

    async def latest_valid(self, job_id: str) -> tuple[Manifest | None, tuple[Skipped, ...]]:
        """The newest checkpoint that verifies (checksums included) and the newer ones skipped."""
        manifest, choice = await asyncio.to_thread(self.store.latest_valid, job_id)
        return manifest, choice.skipped
