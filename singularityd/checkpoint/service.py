"""Checkpointer: what the daemon calls to checkpoint a job's tree and to restore it.

It joins the CRIU driver and the image store: checks the tree, dumps it (after pre-dumps when the
kernel can track dirty memory), verifies and records the images and prunes old checkpoints; the
restoring half is its base class, restoring.Restorer. All methods are coroutines; file hashing
and other blocking work run in threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from singularityd import faults
from singularityd.checkpoint.criu import (
    Criu,
    DumpStats,
    run_to_completion,
)
from singularityd.checkpoint.dump_script import (
    TCP_STREAM_IMAGES,
    dump_files,
    keep_failed_log,
    parse_sizes,
    post_dump_script,
)
from singularityd.checkpoint.errors import CheckpointError, CriuError
from singularityd.checkpoint.hashing import GrowingFileHasher, PrefixHash
from singularityd.checkpoint.manifest import Manifest
from singularityd.checkpoint.namespaces import ExternalMounts, read_external_mounts
from singularityd.checkpoint.precheck import dump_problems, tree_holds_tcp, tree_pids
from singularityd.checkpoint.restoring import Restorer
from singularityd.checkpoint.shm import SharedFile, prepare_copies, shared_memory_files
from singularityd.checkpoint.staging import Staged, StagingArea, mark_staged, move_images
from singularityd.checkpoint.store import (
    ImageStore,
    JobUsage,
    PendingCheckpoint,
    tree_anon_bytes,
)
from singularityd.units import first_few

PAGES_IMAGES = "pages-*.img"
"""CRIU's images of process memory: nearly all of a dump's bytes, each written from start to end."""

AfterDump = Callable[[DumpStats], Awaitable[Mapping[str, Any]]]


def _refuse_files_in_flight(job_id: str, found: Path) -> None:
    """CheckpointError if the dump's action script found files in flight in a socket queue (see
    image_files): the tree runs on, and a checkpoint taken once they are received will do."""
    try:
        paths = found.read_text().splitlines()
    except OSError:
        return
    if paths:
        shown = first_few(paths, ", ")
        raise CheckpointError(
            f"cannot checkpoint job {job_id} now: a process of it sent {shown} over a Unix socket "
            "and none has received it yet; CRIU would reopen it by its path as root at the restore, "
            "where a changed path could hand the job a file its user may not open. The job runs on; "
            "checkpoint it again once it has been received"
        )


def _refuse_unlocked_tcp(job_id: str, image_dir: Path, lock_network: bool) -> None:
    """CheckpointError if a dump taken without CRIU's network lock holds an established TCP connection."""
    if not lock_network and any(image_dir.glob(TCP_STREAM_IMAGES)):
        raise CheckpointError(
            f"job {job_id} opened a TCP connection while it was checkpointed without "
            "CRIU's network lock (it held none before); checkpoint it again"
        )


def _remove_new_files(folder: Path, kept: set[str]) -> None:
    """Remove the files of `folder` whose names are not in `kept` (what a failed dump wrote)."""
    for name in set(os.listdir(folder)) - kept:
        with contextlib.suppress(FileNotFoundError):
            (folder / name).unlink()


@dataclass(frozen=True)
class CheckpointResult:
    """A complete checkpoint and what it cost."""

    job_id: str
    seq: int
    path: Path
    manifest: Manifest
    dump: DumpStats
    pre_dumps: tuple[DumpStats, ...]
    pre_copy_skipped: str
    wall_s: float
    pruned: tuple[int, ...] = ()
    staged: bool = False
    """Whether CRIU wrote the process images to memory, moved to disk after the job ran again."""
    staging_note: str = ""
    """Why the images went straight to disk although staging is on ('' otherwise)."""
    move_s: float = 0.0
    """Seconds the staged images took to reach the disk (copied, flushed and hashed)."""

    @property
    def pause_s(self) -> float:
        """How long the job was frozen by the final dump (its pause, when it keeps running)."""
        return self.dump.pause_s

    @property
    def total_frozen_s(self) -> float:
        """Frozen time summed over the pre-dumps and the final dump."""
        return self.dump.pause_s + sum(p.pause_s for p in self.pre_dumps)

    @property
    def image_bytes(self) -> int:
        """Bytes of all image files of this checkpoint."""
        return self.manifest.total_bytes


class Checkpointer(Restorer):
    """Checkpoints and restores jobs (restoring.Restorer restores); serialises operations per job
    through the store's lock."""

    def __init__(
        self,
        criu: Criu,
        store: ImageStore,
        *,
        keep: int = 3,
        pre_copy: int = 0,
        staging: StagingArea | None = None,
    ) -> None:
        super().__init__(criu, store)
        self.keep = max(1, keep)
        self.pre_copy = pre_copy
        self.staging = staging
        """Where checkpoints taken in place are dumped first (None: straight to disk)."""
        self.userns_problem = ""
        """Why jobs do not run in user namespaces here ("" if they do or need not): told to users
        whose jobs cannot be checkpointed for want of one."""

    def close(self) -> None:
        """Remove the staging folder, if there is one (the daemon stops; the next one opens its own)."""
        if self.staging is not None:
            self.staging.close()

    async def checkpoint(
        self,
        job_id: str,
        pid: int,
        *,
        owner_uid: int,
        owner_gid: int,
        leave_running: bool,
        pre_copy: int | None = None,
        external_unix_inodes: Sequence[int] = (),
        rewind_paths: Sequence[str] = (),
        extra: Mapping[str, Any] | None = None,
        prune: bool = True,
        before_final_dump: Callable[[Path], Any] | None = None,
        after_final_dump: AfterDump | None = None,
        prefixes: Mapping[str, PrefixHash] | None = None,
    ) -> CheckpointResult:
        """Checkpoint the tree rooted at host PID `pid` (the job's init) as the job's next one.

        `leave_running=False` is a preemption: the tree is gone once this returns. If anything
        fails, CheckpointError says why, the tree is still running and the previous checkpoints
        are untouched. `pre_copy` pre-dumps (default: the Checkpointer's) are taken first when the
        kernel tracks dirty memory; otherwise the result says why none were. `rewind_paths` (the
        job's O_APPEND logs) have their sizes recorded at the dump, so a later restore can cut
        them back. `extra` is small JSON state stored in the manifest. `before_final_dump` is
        called with the checkpoint's images folder (and awaited if it returns an awaitable) between
        the pre-dumps and the final dump; what it writes there is checksummed with the images.
        `after_final_dump` is awaited with CRIU's figures as soon as the final dump returns (the
        tree still frozen no more); the mapping it returns is kept in the manifest's stats, and if
        it fails the checkpoint fails. `prefixes` (read when the manifest is written, so they may
        be filled in by `before_final_dump`) are hashes of the beginnings of files of the checkpoint
        that are only appended to since (see ImageStore.finish). With a staging area, a
        checkpoint in place is dumped to memory and moved to disk once `after_final_dump` returned
        (checkpoint.staging), when the area has room for it. Once started, a checkpoint runs to its
        end even if the awaiting task is cancelled.
        """
        return await run_to_completion(
            self._checkpoint(
                job_id,
                pid,
                owner_uid=owner_uid,
                owner_gid=owner_gid,
                leave_running=leave_running,
                pre_copy=pre_copy,
                external_unix_inodes=external_unix_inodes,
                rewind_paths=rewind_paths,
                extra=extra,
                prune=prune,
                before_final_dump=before_final_dump,
                after_final_dump=after_final_dump,
                prefixes=prefixes,
            )
        )

    async def _checkpoint(
        self,
        job_id: str,
        pid: int,
        *,
        owner_uid: int,
        owner_gid: int,
        leave_running: bool,
        pre_copy: int | None,
        external_unix_inodes: Sequence[int],
        rewind_paths: Sequence[str],
        extra: Mapping[str, Any] | None,
        prune: bool,
        before_final_dump: Callable[[Path], Any] | None,
        after_final_dump: AfterDump | None,
        prefixes: Mapping[str, PrefixHash] | None = None,
    ) -> CheckpointResult:
        start = time.monotonic()
        info = self.criu.info
        mounts = await self._dumpable(job_id, pid)
        wanted = self.pre_copy if pre_copy is None else pre_copy
        rounds = wanted if info.dirty_tracking else 0
        skipped = "" if rounds or not wanted else info.dirty_tracking_reason
        with self.store.locked(job_id):
            pids = await asyncio.to_thread(tree_pids, pid)
            needed = await asyncio.to_thread(tree_anon_bytes, pids)
            lock_network = await asyncio.to_thread(tree_holds_tcp, pids)
            shared = await asyncio.to_thread(shared_memory_files, pids, owner_uid)
            pending = await asyncio.to_thread(
                self.store.begin,
                job_id,
                owner_uid=owner_uid,
                owner_gid=owner_gid,
                needed_bytes=needed,
            )
            staged = Staged(None)
            try:
                if leave_running and not rounds:
                    staged = await asyncio.to_thread(self._stage, pending, needed)
                if not leave_running:
                    intent = {
                        "criu_version": info.version_text,
                        "pre_dumps": [f"pre-{i}" for i in range(1, rounds + 1)],
                        "external_unix_inodes": list(external_unix_inodes),
                        "external_mounts": None if mounts is None else dict(mounts),
                        "rewind_paths": list(rewind_paths),
                        "extra": dict(extra or {}),
                    }
                    await asyncio.to_thread(self.store.record_intent, pending, intent)
                pre_stats, dump_stats, sizes, followed, lock_network = await self._dump(
                    pending,
                    staged.folder or pending.images,
                    pid,
                    rounds,
                    leave_running,
                    external_unix_inodes,
                    mounts,
                    rewind_paths,
                    shared,
                    before_final_dump,
                    lock_network,
                )
                after = dict(await after_final_dump(dump_stats)) if after_final_dump else {}
                moved: dict[str, PrefixHash] = {}
                move_s = 0.0
                if staged.folder is not None:
                    began = time.monotonic()
                    moved = await asyncio.to_thread(move_images, staged.folder, pending.images, pending.path)
                    move_s = time.monotonic() - began
            except BaseException:
                await asyncio.to_thread(self.store.abort, pending)
                raise
            finally:
                if staged.folder is not None:
                    await asyncio.to_thread(shutil.rmtree, staged.folder, True)
            stats = {
                "dump": dump_stats.as_dict(),
                "pre_dumps": [p.as_dict() for p in pre_stats],
                "pre_copy_skipped": skipped,
                "staging": {"staged": staged.folder is not None, "move_s": move_s, "reason": staged.reason},
                "network_locked": lock_network,
                "hashed_while_dumped": sum(p.size for p in followed.values()),
                **after,
            }
            try:
                manifest = await asyncio.to_thread(
                    self.store.finish,
                    pending,
                    leave_running=leave_running,
                    criu_version=info.version_text,
                    pre_dumps=[f"pre-{i}" for i in range(1, rounds + 1)],
                    external_unix_inodes=external_unix_inodes,
                    external_mounts=mounts,
                    rewind_sizes=sizes,
                    stats=stats,
                    extra=extra,
                    prefixes={**(prefixes or {}), **followed, **moved},
                )
            except BaseException as e:
                if leave_running:
                    await asyncio.to_thread(self.store.abort, pending)
                    raise
                raise CheckpointError(
                    f"job {job_id} was dumped and stopped, but recording checkpoint "
                    f"{pending.seq} failed ({e}); its images are left in {pending.path}"
                ) from e
            if not leave_running:
                await faults.held_at(faults.STOPPED_DUMP_RECORDED)
            pruned: list[int] = []
            if prune:
                pruned = await asyncio.to_thread(self.store.prune, job_id, self.keep)
        return CheckpointResult(
            job_id=job_id,
            seq=pending.seq,
            path=pending.path,
            manifest=manifest,
            dump=dump_stats,
            pre_dumps=tuple(pre_stats),
            pre_copy_skipped=skipped,
            wall_s=time.monotonic() - start,
            pruned=tuple(pruned),
            staged=staged.folder is not None,
            staging_note=staged.reason,
            move_s=move_s,
        )

    async def dump_in_place(
        self, job_id: str, pid: int, folder: Path, *, external_unix_inodes: Sequence[int], log_file: Path
    ) -> DumpStats:
        """Dump the running tree rooted at host PID `pid` into `folder`, outside the image store and
        without its job lock (a move's base, taken while the move's final checkpoint may hold it),
        with a checkpoint's checks; the tree keeps running. CheckpointError says why it could not be."""
        mounts = await self._dumpable(job_id, pid)
        pids = await asyncio.to_thread(tree_pids, pid)
        lock_network = await asyncio.to_thread(tree_holds_tcp, pids)
        stats = await self.criu.dump(
            pid,
            folder,
            log_file=log_file,
            leave_running=True,
            external_unix_inodes=external_unix_inodes,
            external_mounts=mounts,
            lock_network=lock_network,
        )
        _refuse_unlocked_tcp(job_id, folder, lock_network)
        return stats

    async def _dumpable(self, job_id: str, pid: int) -> ExternalMounts | None:
        """The external mounts of the tree rooted at `pid`; CheckpointError if it cannot be dumped."""
        problems = await asyncio.to_thread(dump_problems, pid, self.criu.info, self.userns_problem)
        if problems:
            raise CheckpointError(f"cannot checkpoint job {job_id}: {problems[0]}")
        try:
            return await asyncio.to_thread(read_external_mounts, pid)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot checkpoint job {job_id}: {e}") from e

    def _stage(self, pending: PendingCheckpoint, expected_bytes: int) -> Staged:
        """A staging folder for this checkpoint's dump, marked in its folder on disk, or why the
        dump goes straight to disk (blocking)."""
        if self.staging is None:
            return Staged(None)
        problem = self.staging.room_problem(expected_bytes)
        if problem:
            return Staged(None, problem)
        folder: Path | None = None
        try:
            folder = self.staging.folder_for(pending.job_id, pending.seq)
            mark_staged(pending.path, folder)
        except OSError as e:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            why = f"the memory staging area cannot be used ({e.strerror or e})"
            return Staged(None, f"{why}: process images written straight to disk")
        return Staged(folder)

    async def _dump(
        self,
        pending: PendingCheckpoint,
        image_dir: Path,
        pid: int,
        rounds: int,
        leave_running: bool,
        external_unix_inodes: Sequence[int],
        mounts: ExternalMounts | None,
        rewind_paths: Sequence[str],
        shared: Sequence[SharedFile],
        before_final_dump: Callable[[Path], Any] | None,
        lock_network: bool,
    ) -> tuple[list[DumpStats], DumpStats, dict[str, int], dict[str, PrefixHash], bool]:
        """Pre-dump, then dump the job into `image_dir` (with copies of its `shared` /dev/shm files);
        the dump's figures, the rewound files' sizes, (for a dump that stops the job, whose manifest
        is on the way to its restore) the pages images as hashed while CRIU wrote them, and whether
        the network lock was taken.

        A dump that stops a tree holding no TCP socket goes without CRIU's network lock (a few
        tenths of a second of the freeze): should a TCP connection have appeared in its images
        since the tree was checked, its action script fails while the tree is still frozen, CRIU
        lets the tree run on, and the dump is taken again under the lock."""
        logs = self.store.logs_dir(pending.job_id)
        tag = f"{pending.seq:08d}"
        dump_log, script_file, sizes_file, in_flight_file = dump_files(logs, pending.seq)
        pre_stats: list[DumpStats] = []
        parent: str | None = None
        for i in range(1, rounds + 1):
            d = pending.pre_dump_dir(i)
            d.mkdir(mode=0o755)
            pre_dump_log = logs / f"pre-dump-{tag}-{i}.log"
            try:
                stats = await self.criu.pre_dump(
                    pid,
                    d,
                    log_file=pre_dump_log,
                    parent_image_dir=parent,
                    external_unix_inodes=external_unix_inodes,
                    external_mounts=mounts,
                )
            except CriuError as error:
                error.log_path = keep_failed_log(pre_dump_log)
                raise
            pre_stats.append(stats)
            parent = f"../pre-{i}"
        if before_final_dump is not None:
            r = before_final_dump(pending.images)
            if asyncio.iscoroutine(r) or isinstance(r, asyncio.Future):
                await r
        following = image_dir == pending.images and not leave_running
        copies = await asyncio.to_thread(prepare_copies, image_dir, shared)
        try:
            while True:
                refusing = not leave_running and not lock_network
                script_file.write_text(
                    post_dump_script(
                        rewind_paths,
                        sizes_file,
                        image_dir if refusing else None,
                        copies,
                        images=image_dir,
                        in_flight_out=in_flight_file,
                    )
                )
                script_file.chmod(0o700)
                written_before = set(os.listdir(image_dir)) if refusing else set()
                hasher = GrowingFileHasher(image_dir, pending.path, PAGES_IMAGES) if following else None
                try:
                    with hasher or contextlib.nullcontext():
                        dump_stats = await self.criu.dump(
                            pid,
                            image_dir,
                            log_file=dump_log,
                            leave_running=leave_running,
                            parent_image_dir=parent,
                            track_mem=rounds > 0,
                            external_unix_inodes=external_unix_inodes,
                            action_script=script_file,
                            external_mounts=mounts,
                            lock_network=lock_network,
                        )
                except CriuError as error:
                    _refuse_files_in_flight(pending.job_id, in_flight_file)
                    if not refusing or not any(image_dir.glob(TCP_STREAM_IMAGES)):
                        error.log_path = keep_failed_log(dump_log)
                        raise
                    await asyncio.to_thread(_remove_new_files, image_dir, written_before)
                    lock_network = True
                    continue
                break
            _refuse_unlocked_tcp(pending.job_id, image_dir, lock_network)
            if not leave_running:
                faults.reached(faults.STOPPING_DUMP_DONE)
            sizes: dict[str, int] = {}
            if rewind_paths:
                with contextlib.suppress(OSError):
                    sizes = parse_sizes(rewind_paths, sizes_file.read_text())
        finally:
            for f in (script_file, sizes_file, in_flight_file):
                with contextlib.suppress(FileNotFoundError):
                    f.unlink()
        followed = hasher.prefixes() if hasher is not None else {}
        return pre_stats, dump_stats, sizes, followed, lock_network

    async def usage(self, job_id: str) -> JobUsage:
        """Disk used by the job's checkpoints (for `sing show`)."""
        return await asyncio.to_thread(self.store.usage, job_id)
