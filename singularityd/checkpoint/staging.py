"""Staging in memory: CRIU writes a checkpoint's process images to a tmpfs, moved to disk after.

CRIU's freeze of a job lasts while it writes the job's process memory. Written to a slow disk
that is most of the pause a checkpoint costs; written to memory it is a copy. The daemon keeps a
root-only folder on a tmpfs (made fresh with a random name at each start, its path recorded in the
image store so the next start removes what a killed daemon left there). A checkpoint taken in
place is dumped into a folder of it; once the job runs again the images are copied into the
checkpoint's folder on disk (hashed while copied, each file flushed), and only then is the
manifest written: until it is, the checkpoint is incomplete and never used. A checkpoint folder
on disk with a staging marker and no manifest was cut short by a daemon restart and is removed
(the job kept running through it). All functions do blocking file I/O: call them from a thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from singularityd import faults
from singularityd.checkpoint.hashing import HASH_CHUNK, PrefixHash
from singularityd.checkpoint.store import STAGED_MARK, read_trusted, write_durably
from singularityd.units import human_bytes

RECORD_NAME = ".staging"
"""In the image store's root: the path of the daemon's current staging folder."""
MARGIN_FRACTION = 0.25
MARGIN_BYTES = 64 << 20
"""Room a tmpfs must have beyond a dump's expected size (the tree's anonymous memory) to stage it."""


def staging_need(expected_bytes: int) -> int:
    """Free bytes a tmpfs must have to stage a dump expected to write `expected_bytes`."""
    return int(expected_bytes * (1 + MARGIN_FRACTION)) + MARGIN_BYTES


@dataclass(frozen=True)
class Staged:
    """Where one checkpoint's process images were dumped, or why they went straight to disk."""

    folder: Path | None
    reason: str = ""
    """Why not staged ('' when staged, or when staging is off)."""


class StagingArea:
    """A root-only folder on a tmpfs that holds process images until they are moved to disk."""

    def __init__(self, root: Path, record: Path | None = None) -> None:
        self.root = root
        self.record = record
        """The file in the image store naming `root` (removed with it)."""

    @classmethod
    def open(cls, base: Path, store_root: Path) -> StagingArea:
        """A fresh staging folder under `base` (mode 0700, random name), after removing the one a
        previous daemon of this store recorded; raises OSError when `base` cannot hold one."""
        record = store_root / RECORD_NAME
        remove_recorded(record)
        root = Path(tempfile.mkdtemp(prefix="singularityd-staging-", dir=base))
        tmp = record.with_name(RECORD_NAME + ".tmp")
        tmp.write_text(str(root))
        os.rename(tmp, record)
        return cls(root, record)

    def room_problem(self, expected_bytes: int) -> str:
        """Why a dump expected to write `expected_bytes` cannot be staged here ('' when it can)."""
        try:
            st = os.statvfs(self.root)
        except OSError as e:
            return f"the staging folder {self.root} cannot be used ({e.strerror})"
        free = st.f_bavail * st.f_frsize
        need = staging_need(expected_bytes)
        if free < need:
            return (
                f"the memory staging area has {human_bytes(free)} free, about {human_bytes(need)} "
                f"needed: process images written straight to disk"
            )
        return ""

    def folder_for(self, job_id: str, seq: int) -> Path:
        """An empty root-only folder for the dump of checkpoint `seq` of a job."""
        folder = self.root / f"{job_id}-{seq:08d}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(mode=0o700)
        return folder

    def close(self) -> None:
        """Remove the staging folder and its record (the daemon stops)."""
        shutil.rmtree(self.root, ignore_errors=True)
        if self.record is not None:
            with contextlib.suppress(FileNotFoundError):
                self.record.unlink()


def remove_recorded(record: Path) -> None:
    """Remove the staging folder a record names, if it is still a root-only folder of ours."""
    try:
        old = Path(record.read_text().strip())
    except OSError:
        return
    with contextlib.suppress(OSError):
        st = os.lstat(old)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077 == 0:
            shutil.rmtree(old, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        record.unlink()


def mark_staged(checkpoint: Path, folder: Path) -> None:
    """Note (durably) in a checkpoint folder that its process images are staged in `folder`."""
    write_durably(checkpoint / STAGED_MARK, json.dumps({"staging_folder": str(folder)}))


def staged_folder(checkpoint: Path, trusted_uid: int) -> Path | None:
    """The staging folder a checkpoint folder's marker names (None without a marker this daemon,
    as `trusted_uid`, wrote)."""
    try:
        return Path(json.loads(read_trusted(checkpoint / STAGED_MARK, trusted_uid))["staging_folder"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def move_images(source: Path, target: Path, base: Path) -> dict[str, PrefixHash]:
    """Copy every file under `source` into `target` (same names, modes; owned by this process),
    flush each to disk, then remove `source`; the sha256 of each by its path relative to `base`.

    The bytes are hashed as they are copied, so recording the checkpoint reads none of them again.
    """
    hashes: dict[str, PrefixHash] = {}
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    for dirpath, dirs, files in os.walk(source):
        here = Path(dirpath)
        into = target / here.relative_to(source)
        for name in dirs:
            (into / name).mkdir(mode=os.lstat(here / name).st_mode & 0o777, exist_ok=True)
        for name in files:
            src = here / name
            st = os.lstat(src)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(src), into / name)
                continue
            h = hashlib.sha256()
            size = 0
            fin = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            fout = os.open(into / name, flags, st.st_mode & 0o777)
            try:
                while n := os.readv(fin, [view]):
                    h.update(view[:n])
                    written = 0
                    while written < n:
                        written += os.write(fout, view[written:n])
                    size += n
                os.fdatasync(fout)
            finally:
                os.close(fin)
                os.close(fout)
            os.unlink(src)  # frees the memory as the move goes
            hashes[(into / name).relative_to(base).as_posix()] = PrefixHash(size, h)
            faults.reached(faults.STAGED_MOVE_RUNNING)
    for dirpath, _dirs, _files in os.walk(target):
        fd = os.open(dirpath, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    shutil.rmtree(source, ignore_errors=True)
    return hashes
