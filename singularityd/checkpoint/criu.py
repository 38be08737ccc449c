"""CRIU driver: dump, pre-dump, restore (finding CRIU: criu_discovery.py; checks: precheck.py).

The methods that run CRIU are coroutines: CRIU runs as a child process through asyncio, so the
daemon's event loop is never blocked. A dump that has started is never interrupted: cancelling the
awaiting task waits for CRIU to finish first (a CRIU killed half-way could leave the job broken).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import stat
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from singularityd import faults
from singularityd.checkpoint.criu_discovery import CriuInfo
from singularityd.checkpoint.criu_log import (
    EXITING_WITH_THREADS,
    FORK_RETRY_PATTERN,
    NO_ERROR_LINE,
    PARASITE_PROC_CLASH,
    PARASITE_PROC_DIR,
    read_log,
    summarize_log,
)
from singularityd.checkpoint.errors import CheckpointUnavailable, CriuError
from singularityd.checkpoint.namespaces import ExternalMounts, dump_mount_args, restore_argv_in_yard
from singularityd.checkpoint.restore_guard import guard_environment, preloading

if TYPE_CHECKING:
    from singularityd.devices.proxy_servers import JobIdentity

log = logging.getLogger(__name__)

LEAVE_STOPPED = "--leave-stopped"
"""The restore option that leaves the restored processes stopped, for the caller to let run."""
T = TypeVar("T")


GHOST_LIMIT_BYTES = 1 << 40
"""Deleted files a job holds open or mapped go into its image whatever their size (CRIU refuses
over 1 MiB unless told): a DataLoader's workers hand every batch over in such a file in
/dev/shm, and a job whose files cannot travel cannot be checkpointed at all; a disk that fills
fails the checkpoint as any other full disk does."""


@dataclass(frozen=True)
class CriuOptions:
    """Knobs of the dumps and restores; the defaults suit the daemon's job trees."""

    log_level: int = 4
    tcp_established: bool = True
    file_locks: bool = True
    network_lock: str | None = None
    ghost_limit_bytes: int | None = GHOST_LIMIT_BYTES
    pre_dump_mode: str = "splice"
    fork_retry_attempts: int = 10
    fork_retry_delay_s: float = 0.2
    proc_clash_attempts: int = 5
    exiting_attempts: int = 10
    exiting_delay_s: float = 0.2
    extra_dump_args: Sequence[str] = ()
    extra_restore_args: Sequence[str] = ()


@dataclass(frozen=True)
class Transient:
    """A CRIU failure that passes: how many tries it gets in all, and what to await between."""

    attempts: int
    between: Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class DumpStats:
    """CRIU's own measurements of a dump or pre-dump (`--display-stats`)."""

    frozen_us: int = 0
    freezing_us: int = 0
    memdump_us: int = 0
    memwrite_us: int = 0
    pages_scanned: int = 0
    pages_skipped_parent: int = 0
    pages_written: int = 0
    wall_s: float = 0.0

    @property
    def pause_s(self) -> float:
        """Seconds the job's processes were frozen by this CRIU call."""
        return self.frozen_us / 1e6

    def as_dict(self) -> dict[str, float]:
        """Plain numbers, for manifests and events."""
        return {
            "frozen_us": self.frozen_us,
            "freezing_us": self.freezing_us,
            "memdump_us": self.memdump_us,
            "memwrite_us": self.memwrite_us,
            "pages_scanned": self.pages_scanned,
            "pages_skipped_parent": self.pages_skipped_parent,
            "pages_written": self.pages_written,
            "wall_s": round(self.wall_s, 6),
        }


@dataclass(frozen=True)
class RestoreOutcome:
    """A restored tree: the host PID of its root, CRIU's timings and how many tries it took."""

    pid: int
    restore_us: int
    forking_us: int
    pages_restored: int
    wall_s: float
    attempts: int


def parse_stats(text: str) -> dict[str, int]:
    """CRIU's `--display-stats` lines ("Frozen time: 950655 us") as snake_case keys."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"\s*([A-Za-z][A-Za-z ]*?):\s*(\d+)", line)
        if m:
            out[m.group(1).strip().lower().replace(" ", "_")] = int(m.group(2))
    return out


def dump_stats_from(text: str, wall_s: float) -> DumpStats:
    """DumpStats from CRIU's stats output."""
    s = parse_stats(text)
    return DumpStats(
        frozen_us=s.get("frozen_time", 0),
        freezing_us=s.get("freezing_time", 0),
        memdump_us=s.get("memory_dump_time", 0),
        memwrite_us=s.get("memory_write_time", 0),
        pages_scanned=s.get("memory_pages_scanned", 0),
        pages_skipped_parent=s.get("memory_pages_skipped_from_parent", 0),
        pages_written=s.get("memory_pages_written", 0),
        wall_s=wall_s,
    )


async def run_to_completion(aw: Awaitable[T]) -> T:
    """Await `aw` to its end even if the caller is cancelled meanwhile, then re-raise the cancel.

    A CRIU dump or a checkpoint half-way through must not be abandoned: the job could be left
    frozen, or killed with its images deleted.
    """
    task = asyncio.ensure_future(aw)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                break
            cancelled = True
    result = task.result()
    if cancelled:
        raise asyncio.CancelledError
    return result


async def _run_to_end(
    argv: Sequence[str],
    pass_fds: Sequence[int] = (),
    started: Callable[[], None] | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[int, str, str, float]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        pass_fds=tuple(pass_fds),
        start_new_session=True,
        env=None if env is None else {**os.environ, **env},
    )
    if started is not None:
        started()
    out, err = await run_to_completion(proc.communicate())
    rc = proc.returncode if proc.returncode is not None else -1
    return rc, out.decode(errors="replace"), err.decode(errors="replace"), loop.time() - start


@dataclass(frozen=True)
class CriuRun:
    """A CRIU run that succeeded: its output, its wall time over every attempt, and how many."""

    output: str
    wall_s: float
    attempts: int


async def _run_retrying(
    argv: Sequence[str],
    log_file: Path,
    what: str,
    *,
    transient: Mapping[str, Transient],
    before: Callable[[], None] | None = None,
    started: Callable[[], None] | None = None,
    pass_fds: Sequence[int] = (),
    env: Mapping[str, str] | None = None,
) -> CriuRun:
    """Run CRIU until it succeeds, trying again while its log names a `transient` cause (up to that
    cause's attempts in all, awaiting its `between` first); CriuError with the log's reason
    otherwise. `before` runs before each attempt, `started` once the first has started; `env` is
    added to CRIU's environment."""
    total = 0.0
    tries: Counter[str] = Counter()
    attempt = 0
    while True:
        attempt += 1
        if before is not None:
            before()
        rc, out, err, wall = await _run_to_end(argv, pass_fds, started if attempt == 1 else None, env)
        total += wall
        if rc == 0:
            return CriuRun(out + err, total, attempt)
        criu_log = read_log(log_file) or err
        cause = next((c for c in transient if c in criu_log), None)
        if cause is None:
            break
        tries[cause] += 1
        if tries[cause] >= transient[cause].attempts:
            break
        log.info("%s failed (%s); trying again", what, summarize_log(criu_log))
        await transient[cause].between()
    reason = summarize_log(criu_log)
    if reason == NO_ERROR_LINE and err.strip():  # failed before it logged (the mount yard's wrapper)
        reason = err.strip().splitlines()[-1]
    raise CriuError(f"{what} failed: {reason}", log_file, rc)


async def _run_dump(
    argv: Sequence[str],
    log_file: Path,
    what: str,
    *,
    pid: int,
    options: CriuOptions,
    started: Callable[[], None] | None = None,
) -> DumpStats:
    """Run a CRIU dump or pre-dump of the tree rooted at `pid`; its statistics, or CriuError with
    the log's reason.

    Two refusals pass, so such a dump is tried again. CRIU's parasite makes a fixed-name directory
    in the working directory of the tree's root when that root's /proc is not of its PID namespace,
    so two dumps at once of trees whose roots share a working directory clash, and one killed at
    that moment leaves the directory behind: it is removed if it stays. And CRIU refuses a process
    caught ending (its main thread gone, its other threads not yet), as a DataLoader worker is at
    the end of each epoch: the dump is taken again a moment later.
    """
    stale = Path(f"/proc/{pid}/cwd") / PARASITE_PROC_DIR
    run = await _run_retrying(
        argv,
        log_file,
        what,
        transient={
            PARASITE_PROC_CLASH: Transient(
                options.proc_clash_attempts, partial(remove_stale_parasite_dir, stale)
            ),
            EXITING_WITH_THREADS: Transient(
                options.exiting_attempts, partial(asyncio.sleep, options.exiting_delay_s)
            ),
        },
        started=started,
    )
    return dump_stats_from(run.output, run.wall_s)


async def remove_stale_parasite_dir(path: Path, settle_s: float = 0.2) -> None:
    """Remove `path`, CRIU's parasite /proc directory, if it is an empty directory that stayed
    for `settle_s` (a dump at work holds it for well under a millisecond)."""
    try:
        before = path.lstat()
    except OSError:
        return
    await asyncio.sleep(settle_s)
    try:
        after = path.lstat()
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino) or not stat.S_ISDIR(after.st_mode):
            return
        os.rmdir(path)
    except OSError:
        return
    log.warning("removed %s, left by a CRIU dump that did not finish", path)


class Criu:
    """Runs CRIU for the daemon; one instance can serve every job (it keeps no per-job state)."""

    def __init__(self, info: CriuInfo, options: CriuOptions | None = None) -> None:
        self.info = info
        self.options = options or CriuOptions()

    @property
    def network_lock(self) -> str:
        """The network-lock method passed to CRIU (configured, else the one found to work)."""
        return self.options.network_lock or self.info.network_lock

    def _common(self, image_dir: Path, log_file: Path) -> list[str]:
        return [
            "-D",
            str(image_dir),
            "-o",
            str(log_file),
            f"-v{self.options.log_level}",
            "--display-stats",
        ]

    def _socket_args(self, lock_network: bool = True) -> list[str]:
        args: list[str] = []
        if self.options.tcp_established:
            args += ["--tcp-established", "--network-lock", self.network_lock if lock_network else "skip"]
        if self.options.file_locks:
            args.append("--file-locks")
        return args

    def dump_argv(
        self,
        pid: int,
        image_dir: Path,
        *,
        log_file: Path,
        leave_running: bool,
        parent_image_dir: str | None = None,
        track_mem: bool = False,
        external_unix_inodes: Sequence[int] = (),
        action_script: Path | None = None,
        external_mounts: ExternalMounts | None = None,
        lock_network: bool = True,
    ) -> list[str]:
        """The CRIU command line of a dump (exposed so tests and logs can show it)."""
        argv = [*self.info.argv, "dump", "-t", str(pid), *self._common(image_dir, log_file)]
        argv += self._socket_args(lock_network)
        if leave_running:
            argv.append("--leave-running")
        if track_mem:
            argv.append("--track-mem")
        if parent_image_dir is not None:
            argv += ["--prev-images-dir", parent_image_dir]
        for inode in external_unix_inodes:
            argv += ["--external", f"unix[{inode}]"]
        argv += dump_mount_args(external_mounts or {})
        if self.options.ghost_limit_bytes is not None:
            argv += ["--ghost-limit", str(self.options.ghost_limit_bytes)]
        if action_script is not None:
            argv += ["--action-script", str(action_script)]
        return argv + list(self.options.extra_dump_args)

    async def dump(
        self,
        pid: int,
        image_dir: Path,
        *,
        log_file: Path,
        leave_running: bool,
        parent_image_dir: str | None = None,
        track_mem: bool = False,
        external_unix_inodes: Sequence[int] = (),
        action_script: Path | None = None,
        external_mounts: ExternalMounts | None = None,
        lock_network: bool = True,
    ) -> DumpStats:
        """Dump the tree rooted at host PID `pid` into `image_dir` (which must exist).

        With `leave_running` the tree goes on after the dump, else CRIU kills it once the images
        are complete. On failure CRIU resumes the tree, and CriuError says why. `parent_image_dir`
        (relative to `image_dir`, e.g. "../pre-2") names the last pre-dump; `track_mem` keeps the
        kernel's dirty tracking on for a later incremental dump. `external_mounts` names the mounts
        a job with its own mount namespace shares with the daemon (see checkpoint.namespaces).
        `lock_network=False` skips CRIU's network lock (`--network-lock skip`), which only guards
        TCP connections and costs a few tenths of a second of the freeze with nftables: for a tree
        that holds none (the caller checks the images for any that appeared meanwhile).
        """
        if track_mem and not self.info.dirty_tracking:
            raise CheckpointUnavailable(self.info.dirty_tracking_reason)
        argv = self.dump_argv(
            pid,
            image_dir,
            log_file=log_file,
            leave_running=leave_running,
            parent_image_dir=parent_image_dir,
            track_mem=track_mem,
            external_unix_inodes=external_unix_inodes,
            action_script=action_script,
            external_mounts=external_mounts,
            lock_network=lock_network,
        )
        started = None if leave_running else partial(faults.reached, faults.STOPPING_DUMP_RUNNING)
        return await _run_dump(
            argv,
            log_file,
            f"dump of pid {pid}",
            pid=pid,
            options=self.options,
            started=started,
        )

    async def pre_dump(
        self,
        pid: int,
        image_dir: Path,
        *,
        log_file: Path,
        parent_image_dir: str | None = None,
        external_unix_inodes: Sequence[int] = (),
        external_mounts: ExternalMounts | None = None,
    ) -> DumpStats:
        """Copy the tree's memory into `image_dir` while it keeps running, tracking what it dirties.

        Needs kernel dirty tracking (CheckpointUnavailable otherwise: CRIU 4 aborts a pre-dump
        without it). Chain pre-dumps with `parent_image_dir`, then finish with `dump(...,
        parent_image_dir=..., track_mem=True)`, which writes only the pages dirtied since.
        """
        if not self.info.dirty_tracking:
            raise CheckpointUnavailable(self.info.dirty_tracking_reason)
        argv = [*self.info.argv, "pre-dump", "-t", str(pid), *self._common(image_dir, log_file)]
        argv += ["--track-mem", "--pre-dump-mode", self.options.pre_dump_mode]
        if parent_image_dir is not None:
            argv += ["--prev-images-dir", parent_image_dir]
        for inode in external_unix_inodes:
            argv += ["--external", f"unix[{inode}]"]
        argv += dump_mount_args(external_mounts or {})
        return await _run_dump(argv, log_file, f"pre-dump of pid {pid}", pid=pid, options=self.options)

    def guards(self, user: JobIdentity | None) -> bool:
        """Whether a restore of `user`'s job runs with the restore guard: CRIU's changes by name
        then carry that user's rights (for a user other than root, where the guard was built)."""
        return user is not None and user.uid != 0 and bool(self.info.restore_guard)

    def _guard_environment(self, user: JobIdentity | None, *places: Path | None) -> dict[str, str] | None:
        """CRIU's added environment for a restore of `user`'s job: the restore guard's, or none."""
        if user is None or not self.guards(user):
            return None
        folders = sorted({place if place.is_dir() else place.parent for place in places if place is not None})
        return guard_environment(user.uid, user.gid, user.groups, folders)

    def restore_argv(
        self,
        image_dir: Path,
        *,
        log_file: Path,
        pidfile: Path,
        inherit_fds: Mapping[str, int],
        external_mounts: ExternalMounts | None = None,
        mount_yard: Path | None = None,
        preload: str = "",
    ) -> list[str]:
        """The command line of a restore: CRIU, or CRIU in a mount yard for a job with its own
        mounts; CRIU alone (not the yard's wrapper) with the library `preload` preloaded."""
        argv = [*preloading(preload), *self.info.argv, "restore", *self._common(image_dir, log_file)]
        argv += ["--restore-detached", "--pidfile", str(pidfile), *self._socket_args()]
        for key, fd in inherit_fds.items():
            argv += ["--inherit-fd", f"fd[{fd}]:{key}"]
        argv += list(self.options.extra_restore_args)
        if LEAVE_STOPPED not in argv:
            argv.append(LEAVE_STOPPED)
        if external_mounts is None:
            return argv
        if mount_yard is None:
            raise ValueError("a job with its own mount namespace is restored through a mount yard")
        return restore_argv_in_yard(argv, external_mounts, mount_yard)

    async def restore(
        self,
        image_dir: Path,
        *,
        log_file: Path,
        pidfile: Path,
        inherit_fds: Mapping[str, int] | None = None,
        external_mounts: ExternalMounts | None = None,
        mount_yard: Path | None = None,
        user: JobIdentity | None = None,
    ) -> RestoreOutcome:
        """Restore the tree in `image_dir` detached from CRIU, its processes left stopped (SIGSTOP:
        see checkpoint.reopened for why); return its root's host PID.

        `inherit_fds` maps a resource as CRIU names it in the images (e.g. "socket:[12345]", an
        external Unix socket of the dump) to an fd open in this process that replaces it. A job
        dumped from its own PID namespace gets a new one, so its PIDs never clash with running
        processes. "Can't fork for PID" (a dumped process not yet reaped) is retried briefly. A job
        dumped with its own mount namespace (`external_mounts` not None, as recorded at the dump)
        is restored through `mount_yard`, an empty directory of the daemon's. A job of `user` other
        than root is restored under the restore guard (checkpoint.restore_guard) when it was built.
        """
        fds = dict(inherit_fds or {})
        if mount_yard is not None:
            mount_yard.mkdir(mode=0o700, exist_ok=True)
        argv = self.restore_argv(
            image_dir,
            log_file=log_file,
            pidfile=pidfile,
            inherit_fds=fds,
            external_mounts=external_mounts,
            mount_yard=mount_yard,
            preload=self.info.restore_guard if self.guards(user) else "",
        )

        def forget_pid() -> None:
            with contextlib.suppress(FileNotFoundError):
                pidfile.unlink()

        run = await _run_retrying(
            argv,
            log_file,
            f"restore from {image_dir}",
            transient={
                FORK_RETRY_PATTERN: Transient(
                    self.options.fork_retry_attempts, partial(asyncio.sleep, self.options.fork_retry_delay_s)
                )
            },
            before=forget_pid,
            pass_fds=sorted(set(fds.values())),
            env=self._guard_environment(user, image_dir, log_file, pidfile, mount_yard),
        )
        try:
            pid = int(pidfile.read_text().strip())
        except (OSError, ValueError) as e:
            raise CriuError(
                f"restore from {image_dir} succeeded but wrote no pid file: {e}", log_file, 0
            ) from e
        s = parse_stats(run.output)
        return RestoreOutcome(
            pid=pid,
            restore_us=s.get("restore_time", 0),
            forking_us=s.get("forking_time", 0),
            pages_restored=s.get("pages_restored", 0),
            wall_s=run.wall_s,
            attempts=run.attempts,
        )
