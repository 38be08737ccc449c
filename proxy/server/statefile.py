"""The device-state file of a checkpoint: a job's tensors on one device, as raw storage bytes and an index.

A proxy server writes it into a file the daemon opened (the descriptor comes with the control
request) and a server of the same job reads it back on restore. It is written front to back in
one pass that may be spread over time: storages copied while the job ran come first, those
changed since come after the job's pause, then the index that says what is where. So a save can
start before the job is parked and end after it runs again (snapshot.py).

Layout (format 2):

    FILE_MAGIC                          8 bytes
    storage records                     the raw bytes of a storage, each at a multiple of ALIGN
    blob records                        torch.save of a tensor that is not a plain strided one
    index                               UTF-8 JSON, see below
    index length (u64), INDEX_MAGIC     the trailer: 16 bytes

Index: {"format": 2, "device": i,
        "storages": {id: [offset, nbytes]}, "blobs": {id: [offset, nbytes]},
        "sessions": [{"job_id", "rank", "index", "process", "connected", "uid",
                      "ops": {op_id: [namespace, name, overload]},
                      "peak", "pending_error", "plans": blob id | null, "queue": blob id | null,
                      "groups": {name: [global rank, members]},
                      "tensors": {handle: ["s", storage id, dtype, shape, stride, offset, flags]
                                          | ["b", blob id]}}]}
`flags` holds "c" (conjugate bit), "n" (negative bit), "g" (requires grad). Tensors that share
a storage name the same storage id, so views stay views of one another's bytes.

Format 1 (a torch.save of {"format": 1, "device", "sessions"}) is still read.
"""

from __future__ import annotations

import io
import json
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from singularity.proxy.bootstrap._singularity_proxy import protocol

FORMAT = 2
FILE_MAGIC = b"SINGDEV2"
INDEX_MAGIC = b"SINGIDX2"
TRAILER = struct.Struct("<Q8s")
ALIGN = 4096
"""Storage records start at multiples of this (page-aligned reads and writes)."""
MAX_INDEX_BYTES = 1 << 30
STAGING_CHUNK = 64 << 20
"""Bytes of device memory staged through host memory at a time (GPU storages)."""
LEGACY_FORMAT = 1


@dataclass
class SavedSession:
    """One job process's session as a device-state file holds it, its tensors rebuilt on a device."""

    job_id: str
    rank: int
    uid: int
    ops: dict[int, tuple[str, str, str]]
    peak: int
    pending_error: list[str] | None
    tensors: dict[int, torch.Tensor]
    plans: dict[Any, Any] = field(default_factory=dict)
    """Plan id -> [op_id, args, kwargs] as the job sent it (Session.plan_wire)."""
    queue: list[Any] = field(default_factory=list)
    """Frames received and not yet run (runner.Work.saved), run after the restore."""
    groups: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    """Process groups of its collectives: name -> (the process's global rank, members)."""
    index: int | None = None
    """The logical device (the process's cuda:index) the session served; None in files older
    than the field (then the rank's only session on the device)."""
    process: int = 0
    """The pid of the process that held it (0 in files older than the field)."""
    settings: dict[str, Any] | None = None
    """The process's numeric settings (protocol.OP_SETTINGS; None: torch's own, and in files older
    than the field)."""
    connected: bool = True
    """Whether its process was connected when the job parked (files older than the field: yes).
    A process that had ended its connection (exiting) holds a dead one, which CRIU restores
    as it was; only connected processes get a connection back."""


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all the bytes of `storage`, on its device, without copying."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def host_view(flat: torch.Tensor) -> memoryview:
    """The bytes of a flat uint8 host tensor (a slice of a storage's bytes), without copying."""
    start = flat.storage_offset()
    return protocol.storage_view(flat)[start : start + flat.numel()]


def is_plain(tensor: torch.Tensor) -> bool:
    """Whether a tensor is saved as storage bytes plus a layout (else as a torch.save blob)."""
    return (
        tensor.layout is torch.strided
        and not tensor.is_quantized
        and tensor.device.type in ("cpu", "cuda")
        and tensor.dtype in protocol.torch_names().dtype_names
    )


def tensor_entry(tensor: torch.Tensor, storage_id: int) -> list[Any]:
    """The index entry of a plain tensor whose storage is saved under `storage_id`."""
    flags = ""
    if tensor.is_conj():
        flags += "c"
    if tensor.is_neg():
        flags += "n"
    if tensor.requires_grad:
        flags += "g"
    return [
        "s",
        storage_id,
        protocol.torch_names().dtype_names[tensor.dtype],
        list(tensor.shape),
        list(tensor.stride()),
        tensor.storage_offset(),
        flags,
    ]


def blob_of(value: Any) -> bytes:
    """A tensor that is not plain (sparse, quantized, ...), or a session's plans, as torch.save writes it."""
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


class StateFileWriter:
    """Appends records to a device-state file open at a descriptor, then its index."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.end = 0
        self._pwrite(FILE_MAGIC, 0)
        self.end = len(FILE_MAGIC)

    def _pwrite(self, data: memoryview | bytes, offset: int) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)

    def append(self, data: memoryview | bytes) -> int:
        """Write one record at the next aligned offset; that offset."""
        offset = -(-self.end // ALIGN) * ALIGN
        self._pwrite(data, offset)
        self.end = offset + memoryview(data).nbytes
        return offset

    def append_bytes(self, flat: torch.Tensor) -> int:
        """Write a flat uint8 tensor's bytes (staged through host memory if on a GPU); their offset."""
        if flat.device.type == "cpu":
            return self.append(host_view(flat))
        offset = -(-self.end // ALIGN) * ALIGN
        stage = torch.empty(min(STAGING_CHUNK, flat.numel()), dtype=torch.uint8, pin_memory=True)
        for start in range(0, flat.numel(), STAGING_CHUNK):
            part = flat[start : start + STAGING_CHUNK]
            stage[: part.numel()].copy_(part)
            self._pwrite(host_view(stage[: part.numel()]), offset + start)
        self.end = offset + flat.numel()
        return offset

    def finish(self, index: Mapping[str, Any]) -> int:
        """Write the index and the trailer; the file's size."""
        body = json.dumps(index, separators=(",", ":")).encode()
        offset = self.end
        self._pwrite(body + TRAILER.pack(len(body), INDEX_MAGIC), offset)
        self.end = offset + len(body) + TRAILER.size
        return self.end


def _pread(fd: int, target: memoryview, offset: int) -> None:
    """Fill `target` with the file's bytes at `offset`; ValueError if the file ends first."""
    done = 0
    while done < len(target):
        got = os.preadv(fd, [target[done:]], offset + done)
        if got <= 0:
            raise ValueError("proxy: the device-state file ends inside a record")
        done += got


def _index(fd: int) -> tuple[dict[str, Any], int]:
    """The index of a format-2 file and where it starts."""
    size = os.fstat(fd).st_size
    if size < len(FILE_MAGIC) + TRAILER.size or os.pread(fd, len(FILE_MAGIC), 0) != FILE_MAGIC:
        raise ValueError("proxy: not a device-state file")
    length, magic = TRAILER.unpack(os.pread(fd, TRAILER.size, size - TRAILER.size))
    start = size - TRAILER.size - length
    if magic != INDEX_MAGIC or length > MAX_INDEX_BYTES or start < len(FILE_MAGIC):
        raise ValueError("proxy: the device-state file has no index (it was not finished)")
    raw = bytearray(length)
    _pread(fd, memoryview(raw), start)
    index = json.loads(raw)
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError("proxy: not a device-state file of this version")
    return index, start


def _records(table: Any, limit: int) -> Iterator[tuple[int, int, int]]:
    """(id, offset, nbytes) of each record of an index table, checked to lie before `limit`."""
    if not isinstance(table, dict):
        raise ValueError("proxy: malformed device-state index")
    for key, entry in table.items():
        offset, nbytes = protocol.integers(entry, most=2)
        if offset + nbytes > limit:
            raise ValueError("proxy: a device-state record lies outside the file")
        yield int(key), offset, nbytes


def read_storage(fd: int, offset: int, nbytes: int, device: torch.device) -> torch.UntypedStorage:
    """A storage on `device` holding `nbytes` of the file from `offset`."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    if nbytes:
        _pread(fd, host_view(host), offset)
    return (host if device.type == "cpu" else host.to(device)).untyped_storage()


def _plain_tensor(
    entry: Sequence[Any], storages: Mapping[int, torch.UntypedStorage], device: torch.device
) -> Any:
    """A tensor rebuilt from its index entry over its (loaded) storage."""
    _, storage_id, dtype, shape, stride, offset, flags = entry
    storage = storages.get(storage_id)
    if storage is None:
        raise ValueError(f"proxy: the device-state index names no storage {storage_id!r}")
    found = protocol.torch_names().dtype(dtype)
    tensor = torch.empty(0, dtype=found, device=device)
    tensor.set_(storage, protocol.integer(offset), protocol.integers(shape), protocol.integers(stride))
    if "c" in flags:
        tensor = tensor.conj()
    if "n" in flags:
        tensor = torch._neg_view(tensor)
    if "g" in flags:
        tensor.requires_grad_(True)
    return tensor


def _groups(saved: Any) -> dict[str, tuple[int, list[int]]]:
    """A session's process groups as saved (name -> [rank, members]), checked."""
    if not saved:
        return {}
    if not isinstance(saved, dict):
        raise ValueError("proxy: malformed process groups in the device-state file")
    return {
        str(name): (protocol.integer(rank), protocol.integers(list(members), most=1 << 16))
        for name, (rank, members) in saved.items()
    }


Preloaded = dict[tuple[int, int], torch.UntypedStorage]
"""Storages already read from a device-state file, by their record's (offset, bytes) (preloads.py)."""


def read_state(
    fd: int, device: torch.device, preloaded: Preloaded | None = None
) -> tuple[int, list[SavedSession]]:
    """The device index and the sessions of the device-state file open at `fd`, their tensors on `device`.

    A storage record found in `preloaded` under the same (offset, bytes) is taken from there (and
    removed from it) instead of read; what is left in `preloaded` afterwards was not used."""
    head = os.pread(fd, len(FILE_MAGIC), 0)
    if head != FILE_MAGIC:
        return _read_legacy(fd, device)
    index, limit = _index(fd)
    ready = preloaded if preloaded is not None else {}
    storages: dict[int, torch.UntypedStorage] = {}
    for sid, off, n in _records(index["storages"], limit):
        found = ready.pop((off, n), None)
        storages[sid] = found if found is not None else read_storage(fd, off, n, device)
    blobs: dict[int, Any] = {}
    for bid, offset, nbytes in _records(index.get("blobs", {}), limit):
        raw = bytearray(nbytes)
        _pread(fd, memoryview(raw), offset)
        blobs[bid] = torch.load(io.BytesIO(raw), map_location=device, weights_only=True)
    sessions = []
    for state in index["sessions"]:
        tensors: dict[int, torch.Tensor] = {}
        for handle, entry in state["tensors"].items():
            if entry[0] == "b":
                tensors[int(handle)] = blobs[int(entry[1])]
            else:
                tensors[int(handle)] = _plain_tensor(entry, storages, device)
        ops = {int(k): (str(v[0]), str(v[1]), str(v[2])) for k, v in state["ops"].items()}
        sessions.append(
            SavedSession(
                str(state["job_id"]),
                int(state["rank"]),
                int(state["uid"]),
                ops,
                int(state["peak"]),
                state["pending_error"],
                tensors,
                blobs[int(state["plans"])] if state.get("plans") is not None else {},
                list(blobs[int(state["queue"])]) if state.get("queue") is not None else [],
                _groups(state.get("groups")),
                protocol.integer(state["index"]) if state.get("index") is not None else None,
                protocol.integer(state.get("process", 0)),
                state.get("settings"),
                state.get("connected", True) is not False,
            )
        )
    return int(index["device"]), sessions


def _read_legacy(fd: int, device: torch.device) -> tuple[int, list[SavedSession]]:
    """A format-1 file (one torch.save of every session)."""
    with os.fdopen(os.dup(fd), "rb") as file:
        saved = torch.load(file, map_location=device, weights_only=True)
    if not isinstance(saved, dict) or saved.get("format") != LEGACY_FORMAT:
        raise ValueError("proxy: not a device-state file of this version")
    sessions = [
        SavedSession(
            str(state["job_id"]),
            int(state["rank"]),
            int(state["uid"]),
            {int(k): tuple(v) for k, v in state["ops"].items()},
            int(state["peak"]),
            state["pending_error"],
            {int(h): t for h, t in state["tensors"].items()},
            dict(state.get("plans") or {}),
            list(state.get("queue") or []),
            _groups(state.get("groups")),
        )
        for state in saved["sessions"]
    ]
    return int(saved["device"]), sessions
