"""Files of the machine's /dev/shm that a job's processes map or hold open, carried in its checkpoints.

multiprocessing's named semaphores and `SharedMemory` blocks, and torch's `file_system` tensors,
live in files of /dev/shm that stay linked while the job runs. CRIU dumps a mapping or descriptor
of a linked file by its path and expects the file to be there, with the same size, at restore;
/dev/shm is the machine's, so a restore on another machine (a move) or after /dev/shm was cleared
would fail, and a restore of an older checkpoint would find the bytes the job wrote since. So the
final dump's action script copies each such file of the job's user beside the images while the
tree is still frozen, and a restore writes them back, as that user's, before CRIU runs.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shlex
import stat
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from singularityd.checkpoint.errors import CheckpointError

SHM = Path("/dev/shm")
SHM_IMAGES = "shm"
"""The folder of a checkpoint's images that holds the copies."""
SHM_INDEX = "files.json"
"""The copies' owners and modes, in that folder."""
SHM_COPIES = "copies"
"""The folder of the copies in it (apart from the index: any name is a file's name in /dev/shm)."""
COPY_CHUNK_BYTES = 64 << 20
"""Most bytes one sendfile of a write-back moves."""


def copy_path(images: Path, name: str) -> Path:
    """Where a checkpoint's images keep their copy of /dev/shm/`name`."""
    return images / SHM_IMAGES / SHM_COPIES / name


class SharedMemoryError(CheckpointError):
    """A saved /dev/shm file cannot be put back."""


@dataclass(frozen=True)
class SharedFile:
    """One file of /dev/shm the job uses, as a restore must recreate it."""

    name: str
    uid: int
    gid: int
    mode: int


def _shm_names(pid: int) -> set[str]:
    """Names of the /dev/shm files (not deleted) a process maps or holds open, as it sees them."""
    paths: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6:
                paths.add(fields[5])
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                paths.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    prefix = f"{SHM}/"
    return {
        path[len(prefix) :]
        for path in paths
        if path.startswith(prefix) and not path.endswith(" (deleted)") and "/" not in path[len(prefix) :]
    }


def shared_memory_files(pids: Sequence[int], owner_uid: int) -> list[SharedFile]:
    """The files of the daemon's /dev/shm that the processes map or hold open and the job's user
    owns (a /dev/shm of the job's own is in CRIU's images already; others' files are not the job's)."""
    found: dict[str, SharedFile] = {}
    for pid in pids:
        for name in _shm_names(pid) - found.keys():
            try:
                theirs = os.stat(f"/proc/{pid}/root{SHM}/{name}", follow_symlinks=False)
                ours = os.stat(SHM / name, follow_symlinks=False)
            except OSError:
                continue
            same = (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)
            if same and stat.S_ISREG(ours.st_mode) and ours.st_uid == owner_uid:
                found[name] = SharedFile(name, ours.st_uid, ours.st_gid, stat.S_IMODE(ours.st_mode))
    return sorted(found.values(), key=lambda f: f.name)


COPY_PROGRAM = """
import os, stat, sys
folder, entries = sys.argv[1], sys.argv[2:]
for uid, name in zip(entries[::2], entries[1::2]):
    copy = os.path.join(folder, name)
    try:
        fd = os.open("/dev/shm/" + name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        continue
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_uid != int(uid):
            sys.exit(f"/dev/shm/{name} is no longer the job's user's file")
        out = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            while chunk := os.read(fd, 1 << 20):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view):]
        finally:
            os.close(out)
    except BaseException:
        try:
            os.unlink(copy)
        except OSError:
            pass
        raise
    finally:
        os.close(fd)
"""
"""Copies the job's /dev/shm files into the images, run by the dump's action script: one process
for all of them (a process per file cost 6-10 ms each in the freeze). It opens each without
following links and copies it only if it is still a regular file of the job's user, so a name
swapped since the listing (for a link to a file only root may read, say) copies nothing."""


def prepare_copies(images: Path, files: Sequence[SharedFile]) -> list[str]:
    """Make the images' folder for the copies and its index; the action script's line that copies
    the files into it while the tree is frozen (COPY_PROGRAM). A file gone meanwhile is skipped;
    a copy that fails (a full disk, a name that changed hands) is removed and fails the script, so
    CRIU lets the tree run on and the checkpoint fails rather than keep what it must not."""
    if not files:
        return []
    folder = images / SHM_IMAGES
    folder.mkdir(mode=0o700, exist_ok=True)
    (folder / SHM_INDEX).write_text(json.dumps([asdict(f) for f in files]))
    (folder / SHM_COPIES).mkdir(mode=0o700, exist_ok=True)
    entries = [part for each in files for part in (str(each.uid), each.name)]
    argv = [sys.executable, "-I", "-S", "-c", COPY_PROGRAM, str(folder / SHM_COPIES), *entries]
    return [f"{shlex.join(argv)} || exit 1"]


def _carried(images: Path) -> list[SharedFile]:
    """The /dev/shm files a checkpoint's images carry (none when they carry none)."""
    try:
        entries = json.loads((images / SHM_IMAGES / SHM_INDEX).read_text())
        saved = [SharedFile(**entry) for entry in entries]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, TypeError) as error:
        raise SharedMemoryError(f"the checkpoint's list of /dev/shm files is unreadable: {error}") from None
    for each in saved:
        if "/" in each.name or each.name in ("", ".", ".."):
            raise SharedMemoryError(f"the checkpoint names a /dev/shm file {each.name!r} outside /dev/shm")
    return saved


def release(folders: Sequence[Path]) -> list[str]:
    """Remove from /dev/shm the files these checkpoints' images carried, where they are still
    their owner's regular files, as the job's processes would have as they ended; the names."""
    removed: list[str] = []
    for images in folders:
        with contextlib.suppress(SharedMemoryError):
            for each in _carried(images):
                path = SHM / each.name
                with contextlib.suppress(OSError):
                    found = os.stat(path, follow_symlinks=False)
                    if stat.S_ISREG(found.st_mode) and found.st_uid == each.uid:
                        path.unlink()
                        removed.append(each.name)
    return removed


def write_back(images: Path) -> list[str]:
    """Put the checkpoint's /dev/shm files back, as their owner's with their modes, over what the
    job left there; the names written. Raises SharedMemoryError for a name another user took."""
    written = []
    for each in _carried(images):
        try:
            source = os.open(copy_path(images, each.name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # gone before the dump: CRIU's images do not map it either
        try:
            _write_one(SHM / each.name, each, source)
        finally:
            os.close(source)
        written.append(each.name)
    return written


def _open_to_write(path: Path, saved: SharedFile) -> int:
    """A descriptor to write `path` through: the file made anew as `saved` says, or the one there,
    if it is the owner's regular file (never through a link, never another user's file)."""
    flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, saved.mode)
    except FileExistsError:
        pass
    else:
        try:
            os.fchown(fd, saved.uid, saved.gid)
        except OSError:
            os.close(fd)
            raise
        return fd
    fd = os.open(path, flags | os.O_NONBLOCK)  # a FIFO put there must not hold the restore for ever
    found = os.fstat(fd)
    if stat.S_ISREG(found.st_mode) and found.st_uid == saved.uid:
        os.set_blocking(fd, True)
        return fd
    os.close(fd)
    if not stat.S_ISREG(found.st_mode):
        raise SharedMemoryError(f"cannot put {path} back: something other than a regular file has its name")
    raise SharedMemoryError(f"cannot put {path} back: another user's file has its name")


def _write_one(path: Path, saved: SharedFile, source: int) -> None:
    """Copy the open file `source` into `path`, with the owner and mode `saved` says (by the
    kernel, a chunk at a time: a shared block may be as large as the job's memory)."""
    try:
        fd = _open_to_write(path, saved)
    except OSError as error:
        raise SharedMemoryError(f"cannot put {path} back: {error.strerror}") from None
    try:
        os.fchmod(fd, saved.mode)
        size = os.fstat(source).st_size
        os.ftruncate(fd, size)
        done = 0
        while done < size:
            sent = os.sendfile(fd, source, done, min(size - done, COPY_CHUNK_BYTES))
            if sent == 0:
                raise OSError(errno.EIO, "the copy ended early")
            done += sent
    except OSError as error:
        raise SharedMemoryError(f"cannot put {path} back: {error.strerror}") from None
    finally:
        os.close(fd)
