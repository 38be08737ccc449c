"""The image store: per-job checkpoint directories, their manifests, verification and pruning.

Layout under the store's root (all blocking file I/O: call from a thread in the event loop):

    <root>/<job_id>/                 root, 0711
        .lock                        flock held by whoever writes or restores this job's images
        logs/                        root, 0700: CRIU logs, pid files, action scripts
        00000007/                    the job's user, 0700 (root while being written or restored)
            images/                  the final dump (root-owned files)
            pre-1/ pre-2/            pre-dumps the final dump refers to through `images/parent`
            manifest.json            written last: size and sha256 of every file

The files inside a checkpoint belong to root, so the job's user (who may list its own checkpoint)
cannot substitute an image that root's CRIU would then restore: verification rejects any file or
directory not owned by the daemon.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import stat
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from singularityd.checkpoint.errors import CheckpointError
from singularityd.checkpoint.hashing import PrefixHash, hash_files
from singularityd.checkpoint.manifest import (
    IMAGES_DIR,
    MANIFEST_NAME,
    Choice,
    FileFact,
    FileRecord,
    Manifest,
    ManifestError,
    Skipped,
    Verdict,
    choose_latest,
    digest_problems,
    next_seq,
    parse_seq_dir_name,
    plan_prune,
    seq_dir_name,
    structural_problems,
)

RESERVE_NAME = ".reserve"
INTENT_NAME = ".intent.json"
"""Written before a dump that stops the job: what recording the checkpoint needs, so that a
daemon restarted after dying in the middle can still record a dump that CRIU finished."""
NEWEST_NAME = ".newest"
"""In a job's folder: the number of its newest complete checkpoint, so that one whose folder was
deleted behind the daemon's back is reported when a restore passes over it, and never renumbered."""
STAGED_MARK = ".staged.json"
"""In a checkpoint folder whose process images are staged in memory (checkpoint.staging), removed
once its manifest is written: a folder with it and no manifest was cut short and is removed."""
RESERVE_BYTES = 1 << 20
JOB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _fact(path: Path) -> FileFact:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return FileFact("missing")
    if stat.S_ISREG(st.st_mode):
        return FileFact("file", st.st_uid, st.st_size)
    if stat.S_ISDIR(st.st_mode):
        return FileFact("dir", st.st_uid, 0)
    if stat.S_ISLNK(st.st_mode):
        return FileFact("symlink", st.st_uid, 0, os.readlink(path))
    return FileFact("other", st.st_uid, 0)


def read_trusted(path: Path, trusted_uid: int) -> str:
    """The text of a file this daemon wrote into a folder the job's user may own, refused
    (OSError) unless it is a regular file owned by `trusted_uid`: the user's FIFO would block the
    reader, a file of theirs would forge what the daemon wrote, a link would lead elsewhere."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != trusted_uid:
            raise PermissionError(errno.EPERM, f"not a regular file owned by uid {trusted_uid}", str(path))
        with os.fdopen(os.dup(fd), "r") as f:
            return f.read()
    finally:
        os.close(fd)


def write_durably(target: Path, text: str) -> None:
    """Replace `target` with `text` atomically and flushed to disk (a temporary file, made afresh
    and never through a link, renamed over it); raises OSError, leaving no temporary file behind."""
    tmp = target.with_name(target.name + ".tmp")
    try:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, target)
    except OSError:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def _space_message(path: Path, err: OSError) -> str:
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on the device of {path} for the checkpoint"
    return f"cannot write {path}: {err.strerror or err}"


@dataclass(frozen=True)
class JobUsage:
    """Disk used by one job's checkpoints."""

    bytes_on_disk: int
    apparent_bytes: int
    checkpoints: int


@dataclass
class PendingCheckpoint:
    """A checkpoint directory being written: not yet usable, removed again if the dump fails."""

    job_id: str
    seq: int
    path: Path
    owner_uid: int
    owner_gid: int

    @property
    def images(self) -> Path:
        """Directory of the final dump."""
        return self.path / IMAGES_DIR

    def pre_dump_dir(self, n: int) -> Path:
        """Directory of the n-th pre-dump (1-based)."""
        return self.path / f"pre-{n}"


class ImageStore:
    """Per-job checkpoint directories under one root; every method does blocking file I/O."""

    def __init__(self, root: Path, *, trusted_uid: int | None = None) -> None:
        self.root = Path(root)
        self.trusted_uid = os.geteuid() if trusted_uid is None else trusted_uid
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)

    def job_dir(self, job_id: str) -> Path:
        """The directory of one job (the id must be a plain name)."""
        if not JOB_ID_RE.fullmatch(job_id):
            raise CheckpointError(f"bad job id {job_id!r} for the image store")
        return self.root / job_id

    def logs_dir(self, job_id: str) -> Path:
        """Root-only directory for a job's CRIU logs and helper files."""
        d = self.job_dir(job_id) / "logs"
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        return d

    def checkpoint_dir(self, job_id: str, seq: int) -> Path:
        """The directory of checkpoint `seq` of a job."""
        return self.job_dir(job_id) / seq_dir_name(seq)

    def _newest_recorded(self, job_id: str) -> int | None:
        """The newest complete checkpoint's number as finish() recorded it (None: none recorded)."""
        try:
            return int(read_trusted(self.job_dir(job_id) / NEWEST_NAME, self.trusted_uid))
        except (OSError, ValueError):
            return None

    def vanished(self, job_id: str) -> list[Skipped]:
        """The newest complete checkpoint, when its folder is gone (deleted outside the daemon)."""
        newest = self._newest_recorded(job_id)
        if newest is None or newest <= max(self.seqs(job_id), default=0):
            return []
        return [Skipped(newest, "its folder is gone: deleted outside singularityd")]

    def seqs(self, job_id: str) -> list[int]:
        """Sequence numbers of the job's checkpoint directories, complete or not, ascending."""
        try:
            names = os.listdir(self.job_dir(job_id))
        except FileNotFoundError:
            return []
        return sorted(s for s in (parse_seq_dir_name(n) for n in names) if s is not None)

    @contextlib.contextmanager
    def locked(self, job_id: str) -> Iterator[None]:
        """Hold the job's store lock; fail at once if another operation holds it."""
        jd = self.job_dir(job_id)
        jd.mkdir(parents=True, exist_ok=True, mode=0o711)
        fd = os.open(jd / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as e:
                raise CheckpointError(f"another checkpoint or restore of job {job_id} is in progress") from e
            yield
        finally:
            os.close(fd)

    def begin(
        self, job_id: str, *, owner_uid: int, owner_gid: int, needed_bytes: int = 0
    ) -> PendingCheckpoint:
        """Create the next checkpoint directory (root-only until finished) with a reserve.

        The reserve keeps room for the manifest, so a dump that fills the disk still leaves space
        to record a complete one. Fails before any dump when the free space is below
        `needed_bytes` (an estimate of the image size).
        """
        jd = self.job_dir(job_id)
        jd.mkdir(parents=True, exist_ok=True, mode=0o711)
        st = os.statvfs(jd)
        free = st.f_bavail * st.f_frsize
        if needed_bytes and free < needed_bytes + RESERVE_BYTES:
            raise CheckpointError(
                f"not enough space for a checkpoint of job {job_id}: about "
                f"{needed_bytes / 2**20:.0f} MiB needed, {free / 2**20:.0f} MiB free in {jd}"
            )
        newest = self._newest_recorded(job_id)
        seq = next_seq([*self.seqs(job_id), *([] if newest is None else [newest])])
        path = jd / seq_dir_name(seq)
        try:
            path.mkdir(mode=0o700)
            os.chown(path, self.trusted_uid, -1)
            os.chmod(jd, 0o711)
            (path / IMAGES_DIR).mkdir(mode=0o755)
            with open(path / RESERVE_NAME, "wb") as f:
                f.write(b"\0" * RESERVE_BYTES)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            shutil.rmtree(path, ignore_errors=True)
            raise CheckpointError(_space_message(path, e)) from e
        return PendingCheckpoint(job_id, seq, path, owner_uid, owner_gid)

    def record_intent(self, pending: PendingCheckpoint, intent: Mapping[str, Any]) -> None:
        """Store (durably) what `finish` will need for this checkpoint, with its owner."""
        facts = {**intent, "owner_uid": pending.owner_uid, "owner_gid": pending.owner_gid}
        try:
            write_durably(pending.path / INTENT_NAME, json.dumps(facts))
        except OSError as e:
            raise CheckpointError(_space_message(pending.path, e)) from e

    def interrupted(self, job_id: str) -> tuple[PendingCheckpoint, dict[str, Any]] | None:
        """The job's newest checkpoint, if it has no manifest but an intent (its daemon died in
        the middle of a dump that stops the job), with that intent."""
        seqs = self.seqs(job_id)
        if not seqs:
            return None
        path = self.checkpoint_dir(job_id, seqs[-1])
        if (path / MANIFEST_NAME).exists():
            with contextlib.suppress(FileNotFoundError):  # left by a daemon killed right after `finish`
                (path / INTENT_NAME).unlink()
            return None
        try:
            intent = json.loads(read_trusted(path / INTENT_NAME, self.trusted_uid))
        except (OSError, ValueError):
            return None
        if not isinstance(intent, dict):
            return None
        owner = int(intent["owner_uid"]), int(intent["owner_gid"])
        return PendingCheckpoint(job_id, seqs[-1], path, *owner), intent

    def cut_short_staged(self, job_id: str) -> PendingCheckpoint | None:
        """The job's newest checkpoint, if it has no manifest but a staging mark (its daemon died
        before the images it dumped to memory were all on disk)."""
        seqs = self.seqs(job_id)
        if not seqs:
            return None
        path = self.checkpoint_dir(job_id, seqs[-1])
        if (path / MANIFEST_NAME).exists():
            return None
        try:
            read_trusted(path / STAGED_MARK, self.trusted_uid)
        except OSError:
            return None
        st = os.lstat(path)
        return PendingCheckpoint(job_id, seqs[-1], path, st.st_uid, st.st_gid)

    def abort(self, pending: PendingCheckpoint) -> None:
        """Remove a checkpoint directory whose dump failed."""
        shutil.rmtree(pending.path, ignore_errors=True)

    def finish(
        self,
        pending: PendingCheckpoint,
        *,
        leave_running: bool,
        criu_version: str,
        pre_dumps: Sequence[str] = (),
        external_unix_inodes: Sequence[int] = (),
        rewind_sizes: Mapping[str, int] | None = None,
        stats: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        external_mounts: Mapping[str, str] | None = None,
        prefixes: Mapping[str, PrefixHash] | None = None,
    ) -> Manifest:
        """Hash every file, write the manifest last (atomically), hand the directory to its owner.

        `prefixes` (by path in the checkpoint) are hashes of the beginnings of append-only files
        taken earlier (the device state pre-copied while the job ran): only the rest is read. The
        intent goes only once the manifest is durable, so a daemon killed while hashing leaves a
        checkpoint its restart still records (`interrupted`)."""
        path = pending.path
        with contextlib.suppress(FileNotFoundError):
            (path / RESERVE_NAME).unlink()
        rels: list[str] = []
        links: dict[str, str] = {}
        for sub in (*pre_dumps, IMAGES_DIR):
            for dirpath, dirs, files in os.walk(path / sub):
                for name in (*dirs, *files):
                    full = Path(dirpath) / name
                    rel = full.relative_to(path).as_posix()
                    if full.is_symlink():
                        links[rel] = os.readlink(full)
                    elif full.is_file():
                        rels.append(rel)
        digests = hash_files(path, sorted(rels), prefixes=prefixes)
        manifest = Manifest(
            job_id=pending.job_id,
            seq=pending.seq,
            created_at=time.time(),
            owner_uid=pending.owner_uid,
            leave_running=leave_running,
            criu_version=criu_version,
            files={r: FileRecord(size=s, sha256=h) for r, (s, h) in digests.items()},
            links=links,
            pre_dumps=tuple(pre_dumps),
            external_unix_inodes=tuple(external_unix_inodes),
            external_mounts=None if external_mounts is None else dict(external_mounts),
            rewind_sizes=dict(rewind_sizes or {}),
            stats=dict(stats or {}),
            extra=dict(extra or {}),
        )
        try:
            write_durably(path / MANIFEST_NAME, manifest.to_json())
            with contextlib.suppress(FileNotFoundError):
                (path / STAGED_MARK).unlink()
            dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            with contextlib.suppress(FileNotFoundError):
                (path / INTENT_NAME).unlink()
        except OSError as e:
            raise CheckpointError(_space_message(path, e)) from e
        if pending.seq > (self._newest_recorded(pending.job_id) or 0):
            with contextlib.suppress(OSError):
                write_durably(self.job_dir(pending.job_id) / NEWEST_NAME, str(pending.seq))
        os.chown(path, pending.owner_uid, pending.owner_gid)
        os.chmod(path, 0o700)
        return manifest

    def read_manifest(self, job_id: str, seq: int) -> Manifest:
        """Load a checkpoint's manifest; raise ManifestError saying why it cannot be used."""
        p = self.checkpoint_dir(job_id, seq) / MANIFEST_NAME
        try:
            text = read_trusted(p, self.trusted_uid)
        except FileNotFoundError as e:
            raise ManifestError("incomplete: no manifest (the dump did not finish)") from e
        except PermissionError as e:
            raise ManifestError(f"the manifest is not a regular file owned by uid {self.trusted_uid}") from e
        except OSError as e:
            raise ManifestError(f"cannot open the manifest: {e.strerror}") from e
        return Manifest.from_json(text)

    def gather_facts(self, job_id: str, seq: int, manifest: Manifest) -> dict[str, FileFact]:
        """lstat facts for every path the manifest names and every directory in the checkpoint."""
        base = self.checkpoint_dir(job_id, seq)
        facts = {rel: _fact(base / rel) for rel in (*manifest.files, *manifest.links)}
        for dirpath, dirs, _files in os.walk(base):
            for d in dirs:
                full = Path(dirpath) / d
                facts[full.relative_to(base).as_posix()] = _fact(full)
        return facts

    def verify(
        self,
        job_id: str,
        seq: int,
        *,
        deep: bool = True,
        known: Mapping[str, str] | None = None,
        checked_later: Collection[str] = (),
    ) -> Verdict:
        """Whether checkpoint `seq` may be restored: structure always, checksums when `deep`.

        `known` gives the sha256 of files hashed as they were written here (by path in the
        checkpoint): those are checked against the manifest without being read again. The
        checksums of `checked_later` are left to the caller (only their structure is checked)."""
        try:
            manifest = self.read_manifest(job_id, seq)
        except ManifestError as e:
            return Verdict.bad(seq, [str(e)])
        facts = self.gather_facts(job_id, seq, manifest)
        problems = structural_problems(
            manifest, facts, expected_job=job_id, expected_seq=seq, trusted_uid=self.trusted_uid
        )
        if problems:
            return Verdict.bad(seq, problems)
        if not deep:
            return Verdict.good(seq)
        checked_here = [rel for rel in manifest.files if rel not in checked_later]
        given = {rel: known[rel] for rel in checked_here if known and rel in known}
        unknown = [rel for rel in checked_here if rel not in given]
        try:
            hashed = hash_files(self.checkpoint_dir(job_id, seq), unknown) if unknown else {}
        except OSError as e:
            return Verdict.bad(seq, [f"cannot read an image file: {e}"])
        problems = digest_problems(manifest, given | {r: h for r, (_s, h) in hashed.items()}, checked_here)
        if problems:
            return Verdict.bad(seq, problems)
        return Verdict.good(seq, sum(size for size, _h in hashed.values()))

    def latest_valid(self, job_id: str, *, deep: bool = True) -> tuple[Manifest | None, Choice]:
        """The newest checkpoint that verifies, and every newer one skipped with its reason.

        Verification goes newest first and stops at the first good one, so older checkpoints
        are not read.
        """
        verdicts: list[Verdict] = []
        for seq in reversed(self.seqs(job_id)):
            v = self.verify(job_id, seq, deep=deep)
            verdicts.append(v)
            if v.ok:
                break
        choice = choose_latest(verdicts)
        if choice.seq is None:
            return None, choice
        return self.read_manifest(job_id, choice.seq), choice

    def prune(self, job_id: str, keep: int, *, deep: bool = False) -> list[int]:
        """Delete all but the newest `keep` good checkpoints and every bad one; return them.

        The newest good checkpoint is never deleted, and nothing is while none is good. The
        default check is structural (manifest, sizes, owners); `deep` also verifies checksums.
        """
        verdicts = [self.verify(job_id, s, deep=deep) for s in self.seqs(job_id)]
        doomed = plan_prune(verdicts, keep)
        for seq in doomed:
            shutil.rmtree(self.checkpoint_dir(job_id, seq), ignore_errors=True)
            self._remove_logs(job_id, seq)
        return doomed

    def _remove_logs(self, job_id: str, seq: int) -> None:
        """Delete the CRIU logs and pid files of checkpoint `seq` (its dump, pre-dumps, restores and
        failed tries), so that a job checkpointed every minute does not fill the disk with them."""
        logs = self.logs_dir(job_id)
        tag = f"{seq:08d}"
        for pattern in (f"*-{tag}.log", f"*-{tag}-*.log", f"*-{tag}.pid"):
            for path in logs.glob(pattern):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def usage(self, job_id: str) -> JobUsage:
        """Bytes on disk (allocated blocks) and apparent bytes of all of a job's checkpoints."""
        on_disk = apparent = 0
        seqs = self.seqs(job_id)
        for seq in seqs:
            for dirpath, _dirs, files in os.walk(self.checkpoint_dir(job_id, seq)):
                for name in files:
                    with contextlib.suppress(FileNotFoundError):
                        st = os.lstat(Path(dirpath) / name)
                        on_disk += st.st_blocks * 512
                        apparent += st.st_size
        return JobUsage(on_disk, apparent, len(seqs))

    def delete_job(self, job_id: str) -> None:
        """Remove every checkpoint and log of a job."""
        shutil.rmtree(self.job_dir(job_id), ignore_errors=True)

    def remove_checkpoints(self, job_id: str) -> None:
        """Remove every checkpoint folder of a job, complete or not (its CRIU logs stay)."""
        for seq in self.seqs(job_id):
            shutil.rmtree(self.checkpoint_dir(job_id, seq), ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (self.job_dir(job_id) / NEWEST_NAME).unlink()

    @contextlib.contextmanager
    def sealed(self, job_id: str, seq: int) -> Iterator[Path]:
        """Make a checkpoint root-only while it is verified and restored, then give it back.

        This closes the window in which the job's user could swap a verified file.
        """
        path = self.checkpoint_dir(job_id, seq)
        st = os.lstat(path)
        os.chown(path, self.trusted_uid, -1)
        os.chmod(path, 0o700)
        try:
            yield path
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.chown(path, st.st_uid, st.st_gid)


def rewind_files(sizes: Mapping[str, int]) -> dict[str, int]:
    """Cut each file back to its size at the dump (log lines written after it would repeat).

    Only regular files longer than recorded are touched; returns the bytes cut from each.
    """
    cut: dict[str, int] = {}
    for path, size in sizes.items():
        if size < 0:
            continue
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_size > size:
                os.ftruncate(fd, size)
                cut[path] = st.st_size - size
        finally:
            os.close(fd)
    return cut


def tree_anon_bytes(pids: Sequence[int]) -> int:
    """Resident anonymous and shared memory of some processes: about what a dump will write."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(("RssAnon:", "RssShmem:")):
                    total += int(line.split()[1]) * 1024
    return total
