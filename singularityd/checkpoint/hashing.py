"""Hashing a checkpoint's files: whole, in parts while they are appended to, and on threads.

The manifest records every file's sha256 (store.py); these spare it rereading what was already
hashed: the beginning of an append-only file hashed while the job ran (`hash_prefixes`), or the
pages images hashed while CRIU wrote them (`GrowingFileHasher`). Blocking file I/O: call from a thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HASH_CHUNK = 4 << 20


@dataclass(frozen=True)
class PrefixHash:
    """The sha256 state after the first `size` bytes of a file that is only appended to."""

    size: int
    state: Any
    """A hashlib sha256 object (copied before being continued)."""


def hash_prefixes(folder: Path, base: Path) -> dict[str, PrefixHash]:
    """The sha256 state of every file under `folder` as it is now, by path relative to `base`
    (hashed while a job runs, for files that will only grow until the manifest is written)."""
    found = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            path = Path(dirpath) / name
            if path.is_file() and not path.is_symlink():
                h = hashlib.sha256()
                size = hash_into(h, path, 0, path.stat().st_size)
                found[path.relative_to(base).as_posix()] = PrefixHash(size, h)
    return found


class GrowingFileHasher:
    """Hashes the files of a folder that match a pattern while another process only appends to
    them (CRIU writing a dump's pages images), so that the manifest, written after, reads only
    what came last. Use as a context manager around the writing; then `prefixes()`."""

    def __init__(self, folder: Path, base: Path, pattern: str, poll_s: float = 0.01) -> None:
        self.folder, self.base, self.pattern, self.poll_s = folder, base, pattern, poll_s
        self._files: dict[Path, tuple[int, int, PrefixHash]] = {}
        """By path: its open fd, its inode, and the hash of what was read of it so far."""
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="growing-file-hasher", daemon=True)
        self._failed = False

    def __enter__(self) -> GrowingFileHasher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        self._thread.join()
        for fd, _, _ in self._files.values():
            os.close(fd)

    def prefixes(self) -> dict[str, PrefixHash]:
        """What was hashed of each file still at its path, by path relative to `base` (after the
        block; the files must only have grown since); none if following failed."""
        found = {}
        for path, (_, inode, prefix) in self._files.items():
            with contextlib.suppress(OSError):
                if os.stat(path, follow_symlinks=False).st_ino == inode and prefix.size:
                    found[path.relative_to(self.base).as_posix()] = prefix
        return {} if self._failed else found

    def _follow(self) -> None:
        buf = bytearray(HASH_CHUNK)
        try:
            while not self._stopping.is_set():
                for path in sorted(self.folder.glob(self.pattern)):
                    self._catch_up(path, memoryview(buf))
                self._stopping.wait(self.poll_s)
        except OSError:
            self._failed = True  # the manifest hashes everything itself

    def _catch_up(self, path: Path, view: memoryview) -> None:
        """Hash what was appended to `path` since the last time."""
        if path not in self._files:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            self._files[path] = (fd, os.fstat(fd).st_ino, PrefixHash(0, hashlib.sha256()))
        fd, inode, prefix = self._files[path]
        end, size = os.fstat(fd).st_size, prefix.size
        while size < end and not self._stopping.is_set():
            n = os.preadv(fd, [view[: min(HASH_CHUNK, end - size)]], size)
            if n == 0:
                break
            prefix.state.update(view[:n])
            size += n
        self._files[path] = (fd, inode, PrefixHash(size, prefix.state))


def hash_file(path: Path, prefix: PrefixHash | None = None) -> tuple[int, str]:
    """Size and sha256 of a file (read in large chunks; hashlib releases the GIL), continuing
    from `prefix` when given and the file is at least that long."""
    if prefix is not None and os.stat(path, follow_symlinks=False).st_size >= prefix.size:
        h = prefix.state.copy()
        return hash_into(h, path, prefix.size, None), h.hexdigest()
    h = hashlib.sha256()
    return hash_into(h, path, 0, None), h.hexdigest()


def hash_into(h: Any, path: Path, offset: int, limit: int | None) -> int:
    """Feed the file's bytes from `offset` (up to `limit` in all, else to its end) into `h`; the
    offset reached."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        return _hash_fd_into(h, fd, offset, limit)
    finally:
        os.close(fd)


def _hash_fd_into(h: Any, fd: int, offset: int, limit: int | None) -> int:
    """hash_into for a file already open as `fd`."""
    size = offset
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    os.lseek(fd, offset, os.SEEK_SET)
    while limit is None or size < limit:
        want = HASH_CHUNK if limit is None else min(HASH_CHUNK, limit - size)
        n = os.readv(fd, [view[:want]])
        if n == 0:
            break
        h.update(view[:n])
        size += n
    return size


def hash_files(
    root: Path, rels: Sequence[str], workers: int = 4, prefixes: Mapping[str, PrefixHash] | None = None
) -> dict[str, tuple[int, str]]:
    """Size and sha256 of each relative path under `root`, hashed on a few threads (continuing
    from the `prefixes` hashed earlier of files that were only appended to since)."""
    known = prefixes or {}
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(rels)))) as pool:
        results = pool.map(lambda r: hash_file(root / r, known.get(r)), rels)
        return dict(zip(rels, results, strict=True))


def open_for_hashing(root: Path, rels: Sequence[str]) -> dict[str, int]:
    """Read-only fds of the relative paths under `root`, for hash_open_files to hash later (the
    files may be renamed meanwhile); none is left open when one cannot be opened."""
    fds: dict[str, int] = {}
    try:
        for rel in rels:
            fds[rel] = os.open(root / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


def hash_open_files(fds: Mapping[str, int], workers: int = 2) -> dict[str, str]:
    """The sha256 of each open file (from its start), on a few threads; closes every fd."""

    def digest(fd: int) -> str:
        h = hashlib.sha256()
        _hash_fd_into(h, fd, 0, None)
        return h.hexdigest()

    try:
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(fds)))) as pool:
            return dict(zip(fds, pool.map(digest, fds.values()), strict=True))
    finally:
        for fd in fds.values():
            os.close(fd)
