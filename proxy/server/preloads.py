"""Device state read ahead of a restore: the pre-copied storages of a device-state file, on the device.

A job moving to this device arrives in two parts: the storages its source pre-copied while it
still ran (the front of the device-state file, which never changes afterwards) and, after its
pause, the rest and the index. `preload` reads the records of the first part the daemon names
(offset, bytes) into storages held for the job, counted in the device's memory; the restore's
`load` then takes each storage whose record the index names (statefile.read_state) and reads only
the others. A preload that does not fit in the device's free memory holds nothing (the restore
reads everything, as without it); one the restore does not take is dropped with the job's release.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch

from singularity.proxy.bootstrap._singularity_proxy import protocol

from .service import Server
from .statefile import ALIGN, FILE_MAGIC, Preloaded, read_storage

MAX_PRELOAD_RECORDS = 1 << 20


def preload_records(records: Any, file_bytes: int) -> list[tuple[int, int]]:
    """The (offset, bytes) records of a preload request, checked to lie in a file of `file_bytes`
    (zero-byte records, which may share an offset, are left out)."""
    if not isinstance(records, list) or len(records) > MAX_PRELOAD_RECORDS:
        raise ValueError("proxy: a preload names a list of [offset, bytes] records")
    found: set[tuple[int, int]] = set()
    for record in records:
        offset, nbytes = protocol.integers(record, most=2)
        if offset < len(FILE_MAGIC) or offset % ALIGN or offset + nbytes > file_bytes:
            raise ValueError(f"proxy: the preload record [{offset}, {nbytes}] lies outside the file")
        if nbytes:
            found.add((offset, nbytes))
    return sorted(found)


class Preloads:
    """The storages read ahead for each job on one server, until its restore takes them or it goes."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.jobs: dict[str, Preloaded] = {}
        self.held: dict[str, int] = {}
        """Bytes of device memory each job's preloaded storages hold (counted in server.memory)."""
        self.reading = threading.Lock()
        """Held while a preload reads, so that a take or a drop waits for it."""

    def preload(self, job_id: str, fd: int, records: Any) -> dict[str, Any]:
        """Read the named records of the file open at `fd` into storages held for the job (any it
        held before are dropped); {"preloaded_bytes", "records", "seconds", "refused"}."""
        began = time.monotonic()
        file_bytes = os.fstat(fd).st_size
        if os.pread(fd, len(FILE_MAGIC), 0) != FILE_MAGIC:
            raise ValueError("proxy: not a device-state file (format 2)")
        wanted = preload_records(records, file_bytes)
        total = sum(nbytes for _, nbytes in wanted)
        with self.reading:
            self._drop_locked(job_id)
            memory = self.server.memory
            with self.server.state_lock:
                if not memory.room_for(total):
                    refusal = (
                        f"{total} bytes of pre-copied state do not fit in the {memory.free_bytes()} bytes "
                        f"free on device {self.server.index}"
                    )
                    return {"preloaded_bytes": 0, "records": 0, "seconds": 0.0, "refused": refusal}
                memory.used += total  # held before reading: a job's allocation meanwhile sees it
                memory.peak = max(memory.peak, memory.used - memory.kept_bytes)
            storages: Preloaded = {}
            try:
                for offset, nbytes in wanted:
                    storages[(offset, nbytes)] = read_storage(fd, offset, nbytes, self.server.device)
                if self.server.device.type == "cuda":
                    torch.cuda.synchronize(self.server.device)
            except BaseException:
                with self.server.state_lock:
                    memory.used -= total
                raise
            self.jobs[job_id] = storages
            self.held[job_id] = total
        return {
            "preloaded_bytes": total,
            "records": len(storages),
            "seconds": time.monotonic() - began,
            "refused": "",
        }

    def take(self, job_id: str) -> Preloaded:
        """The job's preloaded storages, no longer counted here (the sessions that use them count
        them); empty when it has none."""
        with self.reading:
            storages = self.jobs.pop(job_id, {})
            self._uncount(job_id)
        return storages

    def drop(self, job_id: str) -> int:
        """Free the job's preloaded storages; the bytes freed."""
        with self.reading:
            return self._drop_locked(job_id)

    def _drop_locked(self, job_id: str) -> int:
        """`drop` with `reading` held."""
        self.jobs.pop(job_id, None)
        return self._uncount(job_id)

    def _uncount(self, job_id: str) -> int:
        """Stop counting the job's preloaded bytes in the device's memory; those bytes."""
        freed = self.held.pop(job_id, 0)
        if freed:
            with self.server.state_lock:
                self.server.memory.used -= freed
        return freed

    def held_bytes(self) -> dict[str, int]:
        """Bytes of preloaded state held, by job."""
        return dict(self.held)
