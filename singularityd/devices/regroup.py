"""Moving a checkpoint's device state between device counts: the per-device files, split and merged
by session, without loading a tensor.

A checkpoint holds one device-state file per slot of the job (proxy/server/statefile.py), each
with the sessions that slot served: one per process and logical device (rank, cuda:j). Restoring
on another number of devices, each session goes to the slot that now serves its logical device
(splicing.py), so two logical devices of one rank may land on one slot, as two sessions; the records
a session refers to are copied byte for byte into the file of its new slot, with their ids
renumbered, so storages that several sessions share stay shared.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILE_MAGIC = b"SINGDEV2"
INDEX_MAGIC = b"SINGIDX2"
TRAILER = struct.Struct("<Q8s")
ALIGN = 4096
FORMAT = 2
"""The device-state file format (the same values as proxy/server/statefile.py, checked by a test)."""
COPY_CHUNK = 64 << 20


class RegroupError(Exception):
    """The saved device state cannot be spread over the new devices."""


@dataclass(frozen=True)
class SavedFile:
    """One slot's device-state file: its index, and where the index starts."""

    path: Path
    index: dict[str, Any]
    limit: int


def read_index(path: Path) -> SavedFile:
    """The index of a device-state file (format 2)."""
    with path.open("rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size < len(FILE_MAGIC) + TRAILER.size or file.read(len(FILE_MAGIC)) != FILE_MAGIC:
            raise RegroupError(f"{path.name} is not a device-state file of this version")
        file.seek(size - TRAILER.size)
        length, magic = TRAILER.unpack(file.read(TRAILER.size))
        start = size - TRAILER.size - length
        if magic != INDEX_MAGIC or start < len(FILE_MAGIC):
            raise RegroupError(f"{path.name} has no index (it was not finished)")
        file.seek(start)
        index = json.loads(file.read(length))
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise RegroupError(f"{path.name} is not a device-state file of this version")
    return SavedFile(path, index, start)


def _copy(source: int, target: int, offset: int, nbytes: int, at: int) -> None:
    """Copy `nbytes` of `source` at `offset` into `target` at `at`."""
    done = 0
    while done < nbytes:
        count = min(COPY_CHUNK, nbytes - done)
        copied = os.copy_file_range(source, target, count, offset + done, at + done)
        if copied <= 0:
            raise RegroupError("a device-state file ends inside a record")
        done += copied


class _Writer:
    """A new device-state file, written front to back: records, then the index."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        os.pwrite(self.fd, FILE_MAGIC, 0)
        self.end = len(FILE_MAGIC)
        self.tables: dict[str, dict[str, list[int]]] = {"storages": {}, "blobs": {}}
        self.renamed: dict[tuple[str, Path, int], int] = {}

    def record(self, table: str, saved: SavedFile, source: int, record_id: int) -> int:
        """The new id of a record of `saved`, copied here on first use."""
        key = (table, saved.path, record_id)
        found = self.renamed.get(key)
        if found is not None:
            return found
        entry = saved.index.get(table, {}).get(str(record_id))
        if entry is None:
            raise RegroupError(f"{saved.path.name} names no {table[:-1]} {record_id}")
        offset, nbytes = int(entry[0]), int(entry[1])
        if offset + nbytes > saved.limit:
            raise RegroupError(f"{saved.path.name}: a record lies outside the file")
        at = -(-self.end // ALIGN) * ALIGN
        _copy(source, self.fd, offset, nbytes, at)
        self.end = at + nbytes
        new = len(self.tables[table])
        self.tables[table][str(new)] = [at, nbytes]
        self.renamed[key] = new
        return new

    def finish(self, slot: int, sessions: list[dict[str, Any]]) -> None:
        """Write the index and the trailer, and close."""
        body = json.dumps({"format": FORMAT, "device": slot, **self.tables, "sessions": sessions}).encode()
        os.pwrite(self.fd, body + TRAILER.pack(len(body), INDEX_MAGIC), self.end)
        os.fsync(self.fd)
        os.close(self.fd)


def _moved_session(writer: _Writer, saved: SavedFile, source: int, session: dict[str, Any]) -> dict[str, Any]:
    """A session's index entry with its records copied into `writer`."""
    moved = dict(session)
    tensors = {}
    for handle, entry in session["tensors"].items():
        table = "storages" if entry[0] == "s" else "blobs"
        tensors[handle] = [entry[0], writer.record(table, saved, source, int(entry[1])), *entry[2:]]
    moved["tensors"] = tensors
    for key in ("plans", "queue"):
        if session.get(key) is not None:
            moved[key] = writer.record("blobs", saved, source, int(session[key]))
    return moved


def regroup(
    sources: Sequence[Path | None], new_slots: Sequence[int], servers: int, folder: Path
) -> list[Path | None]:
    """Write the state of `servers` slots into `folder` from the old slots' files (None: no file);
    the new files by slot (None where no session goes).

    Each session goes to the slot that now serves its logical device: `new_slots[j]` for cuda:j.
    That includes the sessions of processes that ended before the checkpoint with work still to
    run (a rank that never waited for its device): other ranks' collectives wait for that work."""
    folder.mkdir(parents=True, exist_ok=True)
    saved = [read_index(path) if path is not None else None for path in sources]
    wanted: dict[int, list[tuple[SavedFile, dict[str, Any]]]] = {}
    for found in saved:
        if found is None:
            continue
        for session in found.index.get("sessions", []):
            if session.get("index") is None:
                raise RegroupError(
                    f"{found.path.name} was saved before sessions named their device: "
                    "it can be restored on its own number of devices only"
                )
            rank, logical = int(session["rank"]), int(session["index"])
            if not 0 <= logical < len(new_slots):
                beyond = f"beyond the job's {len(new_slots)} devices"
                raise RegroupError(f"rank {rank} used cuda:{logical}, {beyond}")
            wanted.setdefault(new_slots[logical], []).append((found, session))
    results: list[Path | None] = []
    for slot in range(servers):
        if slot not in wanted:
            results.append(None)
            continue
        path = folder / f"cuda{slot}.state"
        writer = _Writer(path)
        sessions = []
        try:
            opened: dict[Path, int] = {}
            for found, session in wanted[slot]:
                if found.path not in opened:
                    opened[found.path] = os.open(found.path, os.O_RDONLY | os.O_CLOEXEC)
                sessions.append(_moved_session(writer, found, opened[found.path], session))
            writer.finish(slot, sorted(sessions, key=lambda s: int(s["rank"])))
        finally:
            for fd in opened.values():
                os.close(fd)
        results.append(path)
    return results
