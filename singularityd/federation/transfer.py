"""Moving a checkpoint directory to a peer in checksummed chunks, resumable after a broken link.

A directory (CRIU images, the proxies' device-state files, logs) is described by its entries
(path, size, mode, or a symbolic link's target) and cut into chunks of `chunk_size` bytes. The
sender reads and hashes each chunk (sha256); the receiver checks each chunk against its digest
on arrival, writes it in place and notes it in a journal, so that after a broken connection it
can say exactly which chunks it holds and nothing it holds is sent again. At the end the sender
gives the digest of every chunk (the manifest) and the receiver checks that it holds all of them,
optionally re-reading the files from disk. The receiver also hashes each file whole as its chunks
are written in order (`FileHashes`, kept across the transfers of one move: the pre-copy while the
job runs and the rest after it stops), so that the file's sha256 is known at the end without
reading it again (`Destination.file_digests`), but for what arrived out of order.

This module is the transport-free core; `transfer_grpc` moves the chunks over the peer service.
Blocking file I/O throughout: call it from a thread in the event loop.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from singularityd.checkpoint.hashing import hash_into
from singularityd.checkpoint.manifest import path_is_safe

MiB = 1 << 20
MIN_CHUNK = 1 * MiB
MAX_CHUNK = 4 * MiB
DEFAULT_CHUNK = 1 * MiB
JOURNAL = ".transfer-journal"

ChunkKey = tuple[int, int]


class TransferError(RuntimeError):
    """A transfer that cannot go on; the message (one line) says why."""


@dataclass(frozen=True)
class Entry:
    """One file (or symbolic link) of the directory being moved."""

    path: str
    size: int
    mode: int
    link: str = ""


@dataclass(frozen=True)
class Progress:
    """How far a transfer is: `moved` bytes of `total` are at the receiver, `sent` went over the link."""

    phase: str
    moved: int
    total: int
    sent: int = 0


ProgressCallback = Callable[[Progress], None]


def digest(data: bytes | memoryview) -> bytes:
    """The sha256 of a chunk (hashlib releases the GIL, so threads hash in parallel)."""
    return hashlib.sha256(data).digest()


def check_chunk_size(chunk_size: int) -> int:
    """Return `chunk_size` if it is between 1 and 4 MiB (gRPC's default message limit is 4 MiB)."""
    if not MIN_CHUNK <= chunk_size <= MAX_CHUNK:
        raise TransferError(f"chunk size {chunk_size} is outside {MIN_CHUNK}..{MAX_CHUNK} bytes")
    return chunk_size


def scan(root: Path) -> list[Entry]:
    """The entries of a directory, in path order: regular files, and links that stay inside it."""
    entries = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        base = Path(dirpath)
        for name in sorted([*filenames, *(d for d in dirnames if (base / d).is_symlink())]):
            path = base / name
            rel = path.relative_to(root).as_posix()
            if rel == JOURNAL:
                continue
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                entries.append(Entry(rel, 0, 0o777, os.readlink(path)))
            elif stat.S_ISREG(info.st_mode):
                entries.append(Entry(rel, info.st_size, stat.S_IMODE(info.st_mode)))
            else:
                raise TransferError(f"{path} is neither a regular file nor a link")
    return sorted(entries, key=lambda e: e.path)


def entry_problems(entries: Sequence[Entry]) -> list[str]:
    """Paths or links that would escape the transfer's directory, or appear twice."""
    problems, seen = [], set()
    for e in entries:
        if not path_is_safe(e.path) or e.path == JOURNAL:
            problems.append(f"unsafe path {e.path!r}")
        elif e.path in seen:
            problems.append(f"{e.path} is listed twice")
        elif e.link and not _link_stays_inside(e.path, e.link):
            problems.append(f"link {e.path} -> {e.link} leaves the transfer")
        seen.add(e.path)
    return problems


def _link_stays_inside(path: str, target: str) -> bool:
    if target.startswith("/"):
        return False
    depth = len(path.split("/")) - 1
    for part in target.split("/"):
        depth += -1 if part == ".." else 0 if part in ("", ".") else 1
        if depth < 0:
            return False
    return True


def journal_header(entries: Sequence[Entry], chunk_size: int) -> str:
    """The first line of a receiver's journal: what it receives, so a changed transfer starts afresh."""
    return json.dumps(
        {"chunk_size": chunk_size, "entries": [[e.path, e.size, e.mode, e.link] for e in entries]}
    )


def plan(entries: Sequence[Entry], chunk_size: int) -> Iterator[tuple[ChunkKey, int, int]]:
    """Every chunk as ((file, index), offset, length), in order; empty files and links have none."""
    for f, e in enumerate(entries):
        for i in range((e.size + chunk_size - 1) // chunk_size if not e.link else 0):
            offset = i * chunk_size
            yield (f, i), offset, min(chunk_size, e.size - offset)


def total_bytes(entries: Sequence[Entry]) -> int:
    """Bytes of file content to move."""
    return sum(e.size for e in entries if not e.link)


class Source:
    """The sending side of one directory: reads and hashes chunks, remembering their digests."""

    def __init__(self, root: Path, chunk_size: int = DEFAULT_CHUNK, entries: Sequence[Entry] | None = None):
        self.root = root
        self.chunk_size = check_chunk_size(chunk_size)
        self.entries = list(entries) if entries is not None else scan(root)
        self.chunks = {key: (offset, length) for key, offset, length in plan(self.entries, self.chunk_size)}
        self.digests: dict[ChunkKey, bytes] = {}

    @property
    def total(self) -> int:
        """Bytes of file content to move."""
        return total_bytes(self.entries)

    def read(self, key: ChunkKey) -> tuple[bytes, bytes]:
        """(digest, data) of one chunk, read from disk now."""
        offset, length = self.chunks[key]
        fd = os.open(self.root / self.entries[key[0]].path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            data = os.pread(fd, length, offset)
        finally:
            os.close(fd)
        if len(data) != length:
            raise TransferError(f"{self.entries[key[0]].path} changed size while being sent")
        self.digests[key] = digest(data)
        return self.digests[key], data

    def digest_of(self, key: ChunkKey) -> bytes:
        """The chunk's digest, reading it only if this source has not read it yet."""
        known = self.digests.get(key)
        return known if known is not None else self.read(key)[0]

    def manifest(self) -> dict[ChunkKey, bytes]:
        """The digest of every chunk."""
        return {key: self.digest_of(key) for key in self.chunks}


OUT_OF_ORDER_BYTES = 32 * MiB
"""Chunks that arrive ahead of their file's hash are kept in memory up to this much (per transfer);
beyond it they are read back from disk at the end."""


@dataclass
class RunningHash:
    """The sha256 of a file's first `offset` bytes as they were written, and of the bytes before
    the last piece fed (so that piece alone may be written again, longer: a pre-copied file's
    partial last chunk), and the pieces written ahead of `offset`."""

    offset: int = 0
    sha256: Any = field(default_factory=hashlib.sha256)
    before: tuple[int, Any] = (0, None)
    ahead: dict[int, bytes] = field(default_factory=dict)

    def feed(self, data: bytes) -> None:
        """Hash the bytes that follow `offset`."""
        self.before = (self.offset, self.sha256.copy())
        self.sha256.update(data)
        self.offset += len(data)


class FileHashes:
    """The sha256 of each file of a transfer over the bytes written into it in order, by path;
    what was written out of order (beyond `OUT_OF_ORDER_BYTES`) or over bytes already hashed with
    other content is left to `digest`, which reads it from disk. One writer at a time."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.files: dict[str, RunningHash] = {}
        self.ahead_bytes = 0

    def wrote(self, path: str, offset: int, data: bytes, *, unchanged: bool) -> None:
        """Note `data` written at `offset` of `path` (`unchanged`: those bytes were there already)."""
        running = self.files.setdefault(path, RunningHash())
        if offset < running.offset:
            if unchanged:
                return
            if offset == running.before[0] and running.before[1] is not None:
                running.offset, running.sha256 = offset, running.before[1]
                running.before = (offset, None)
            else:  # bytes already hashed changed: start over (read from disk at the end)
                self._drop_ahead(running)
                self.files[path] = running = RunningHash()
                return
        if offset > running.offset:
            if self.ahead_bytes + len(data) <= OUT_OF_ORDER_BYTES:
                self.ahead_bytes += len(data) - len(running.ahead.get(offset, b""))
                running.ahead[offset] = data
            return
        running.feed(data)
        while running.offset in running.ahead:
            piece = running.ahead.pop(running.offset)
            self.ahead_bytes -= len(piece)
            running.feed(piece)

    def _drop_ahead(self, running: RunningHash) -> None:
        self.ahead_bytes -= sum(len(piece) for piece in running.ahead.values())
        running.ahead.clear()

    def digest(self, root: Path, path: str, size: int) -> tuple[str, int]:
        """The sha256 (hex) of the file's first `size` bytes, and how many of them were read
        from disk for it (those not hashed as they were written)."""
        running = self.files.get(path)
        if running is None or running.offset > size:
            running = RunningHash()
        sha256 = running.sha256.copy()
        end = hash_into(sha256, root / path, running.offset, size) if running.offset < size else size
        if end != size:
            raise TransferError(f"{path} holds {end} bytes, expected {size}")
        return sha256.hexdigest(), size - running.offset


class Destination:
    """The receiving side of one transfer into one directory, with a journal of verified chunks.

    `hashes`: the running hashes of an earlier transfer into the same directory with the same
    chunk size (the pre-copy of the same move), continued by this one."""

    def __init__(
        self, root: Path, entries: Sequence[Entry], chunk_size: int, hashes: FileHashes | None = None
    ) -> None:
        problems = entry_problems(entries)
        if problems:
            raise TransferError("; ".join(problems[:3]))
        self.root = root
        self.entries = list(entries)
        self.chunk_size = check_chunk_size(chunk_size)
        self.chunks = {key: (offset, length) for key, offset, length in plan(self.entries, chunk_size)}
        self.held: dict[ChunkKey, bytes] = {}
        self.closed = False
        self.hashes = (
            hashes if hashes is not None and hashes.chunk_size == chunk_size else FileHashes(chunk_size)
        )
        self.file_digests: dict[str, str] = {}
        """Once finished: the sha256 of every file received, by path (see FileHashes)."""
        self.reread_bytes = 0
        """Once finished: bytes read back from disk to know `file_digests`."""
        self._fds: dict[int, int] = {}
        self._journal_header = journal_header(self.entries, chunk_size)
        self._open()

    def matches(self, entries: Sequence[Entry], chunk_size: int) -> bool:
        """Whether this destination receives exactly these entries in chunks of this size."""
        return self._journal_header == journal_header(entries, chunk_size)

    def _open(self) -> None:
        """Reuse what an earlier attempt left: all of it with the same entries; otherwise the
        chunks it wrote at the same place of a file of the same path with the same length (an
        earlier transfer of a prefix of append-only files, such as a pre-copy)."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        journal = self.root / JOURNAL
        lines = journal.read_text().splitlines() if journal.exists() else []
        if lines and lines[0] == self._journal_header:
            self.held = _journaled(lines[1:], lambda key: key if key in self.chunks else None)
        else:
            carried: dict[ChunkKey, bytes] = {}
            with contextlib.suppress(ValueError, KeyError, TypeError):
                earlier = json.loads(lines[0]) if lines else {}
                before = [Entry(*row) for row in earlier["entries"]]
                carry = _same_chunks(before, int(earlier["chunk_size"]), self.entries, self.chunk_size)
                carried = _journaled(lines[1:], carry.get)
            journal.write_text(self._journal_header + "\n")
            os.chmod(journal, 0o600)
            with open(journal, "a") as out:
                out.writelines(f"{f} {i} {d.hex()}\n" for (f, i), d in carried.items())
            self.held = carried
        self._journal = open(journal, "a")  # noqa: SIM115 - kept open across chunks, closed by close()

    @property
    def complete(self) -> bool:
        """Whether every chunk of the transfer is here and verified."""
        return len(self.held) == len(self.chunks)

    @property
    def bytes_held(self) -> int:
        """Bytes of the chunks already here and verified."""
        return sum(self.chunks[key][1] for key in self.held)

    def put(self, key: ChunkKey, chunk_digest: bytes, data: bytes) -> None:
        """Check one chunk against its digest and size, write it in place and journal it."""
        self.verify(key, chunk_digest, data)
        self.write(key, chunk_digest, data)

    def verify(self, key: ChunkKey, chunk_digest: bytes, data: bytes) -> None:
        """Raise TransferError unless the chunk belongs here, has its length and matches its digest."""
        if key not in self.chunks:
            raise TransferError(f"chunk {key} is not part of this transfer")
        length = self.chunks[key][1]
        if len(data) != length:
            raise TransferError(f"chunk {key} has {len(data)} bytes, expected {length}")
        if digest(data) != chunk_digest:
            raise TransferError(f"chunk {key} of {self.entries[key[0]].path} fails its checksum")

    def write(self, key: ChunkKey, chunk_digest: bytes, data: bytes) -> None:
        """Write a verified chunk in place and journal it (one writer at a time)."""
        if self.closed:
            raise TransferError("the transfer was closed (cancelled, or reopened by the sender)")
        offset = self.chunks[key][0]
        os.pwrite(self._fd(key[0]), data, offset)
        unchanged = self.held.get(key) == chunk_digest
        self.hashes.wrote(self.entries[key[0]].path, offset, data, unchanged=unchanged)
        self._journal.write(f"{key[0]} {key[1]} {chunk_digest.hex()}\n")
        self._journal.flush()
        self.held[key] = chunk_digest

    def flush(self) -> None:
        """Write what arrived so far to disk (one writer at a time): after the pre-copy's chunks,
        while the job still runs, so that `finish` has only the rest to flush."""
        if not self.closed:
            for fd in self._fds.values():
                os.fdatasync(fd)

    def _fd(self, f: int) -> int:
        fd = self._fds.get(f)
        if fd is None:
            path = self.root / self.entries[f].path
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            self._fds[f] = fd
        return fd

    def finish(self, manifest: Mapping[ChunkKey, bytes], *, reread: bool = False) -> list[str]:
        """Problems left once every chunk is checked against the sender's manifest; [] when complete.

        On success the files get their sizes and modes, links are made, everything is flushed to
        disk, `file_digests` holds the sha256 of every file and the journal is removed.
        """
        problems = [
            f"manifest names chunk {k} which is not part of this transfer"
            for k in manifest
            if k not in self.chunks
        ]
        for key in self.chunks:
            expected = manifest.get(key)
            if expected is None:
                problems.append(f"manifest lacks chunk {key}")
            elif self.held.get(key) != expected:
                how = "missing" if key not in self.held else "different"
                problems.append(f"chunk {key[1]} of {self.entries[key[0]].path} is {how}")
        if not problems and reread:
            problems += self._reread(manifest)
        if problems:
            return problems
        digests, reread_bytes = {}, 0
        for e in self.entries:
            if not e.link:
                try:
                    digests[e.path], read = self.hashes.digest(self.root, e.path, e.size)
                except (TransferError, OSError) as error:
                    return [f"cannot hash {e.path}: {error}"]
                reread_bytes += read
        for f, e in enumerate(self.entries):
            path = self.root / e.path
            if e.link:
                path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                os.symlink(e.link, path)
                continue
            fd = self._fd(f)
            os.ftruncate(fd, e.size)
            os.fchmod(fd, e.mode & 0o777)
            os.fsync(fd)
        self.close()
        (self.root / JOURNAL).unlink()
        self.file_digests, self.reread_bytes = digests, reread_bytes
        return []

    def _reread(self, manifest: Mapping[ChunkKey, bytes]) -> list[str]:
        problems = []
        for key, (offset, length) in self.chunks.items():
            with open(self.root / self.entries[key[0]].path, "rb") as handle:
                handle.seek(offset)
                if digest(handle.read(length)) != manifest[key]:
                    problems.append(f"chunk {key[1]} of {self.entries[key[0]].path} differs on disk")
        return problems

    def close(self) -> None:
        """Close the files and the journal (the data stays, for a later attempt to resume)."""
        self.closed = True
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if not self._journal.closed:
            self._journal.close()


def _journaled(lines: Sequence[str], where: Callable[[ChunkKey], ChunkKey | None]) -> dict[ChunkKey, bytes]:
    """The chunks a journal's lines record, under the keys `where` gives them (None: dropped)."""
    held = {}
    for line in lines:
        with contextlib.suppress(ValueError):
            f, i, hexdigest = line.split()
            key = where((int(f), int(i)))
            if key is not None:
                held[key] = bytes.fromhex(hexdigest)
    return held


def _same_chunks(
    before: Sequence[Entry], before_chunk: int, after: Sequence[Entry], after_chunk: int
) -> dict[ChunkKey, ChunkKey]:
    """Chunks of `before` that are chunks of `after` too (same path, offset and length)."""
    if before_chunk != after_chunk:
        return {}
    old = {key: (before[key[0]].path, offset, length) for key, offset, length in plan(before, before_chunk)}
    new = {(after[key[0]].path, offset, length): key for key, offset, length in plan(after, after_chunk)}
    return {key: new[place] for key, place in old.items() if place in new}


def adopt_digests(source: Source, earlier: Source) -> int:
    """Give `source` the digests `earlier` computed for the same chunks (same path, offset and
    length) of append-only files, so they are neither read nor hashed again; bytes adopted."""
    same = _same_chunks(earlier.entries, earlier.chunk_size, source.entries, source.chunk_size)
    adopted = 0
    for key, chunk_digest in earlier.digests.items():
        if key in same:
            source.digests[same[key]] = chunk_digest
            adopted += source.chunks[same[key]][1]
    return adopted


def missing(source: Source, held: Mapping[ChunkKey, bytes]) -> list[ChunkKey]:
    """Chunks the receiver must still get: those it lacks or holds with another digest than ours."""
    return [key for key in source.chunks if held.get(key) is None or held[key] != source.digest_of(key)]


def copy_locally(
    source: Source, destination: Destination, progress: ProgressCallback | None = None
) -> list[str]:
    """Move a directory without a network (tests and same-machine moves): the whole protocol in-process."""
    moved, sent = destination.bytes_held, 0
    for key in missing(source, destination.held):
        chunk_digest, data = source.read(key)
        destination.put(key, chunk_digest, data)
        moved, sent = moved + len(data), sent + len(data)
        if progress:
            progress(Progress("sending", moved, source.total, sent))
    return destination.finish(source.manifest())
