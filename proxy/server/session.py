"""What one job process holds on a device, and the device's memory accounting.

A session is keyed by (job id, rank). It owns the process's tensors by handle, the operators
the process defined, its memory figures, the first error of an operation not yet reported,
and its park state. Memory is counted per storage (views share their base's bytes), per
session and for the whole device, whose capacity is what the program sees as total memory.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import threading
from typing import Any

import torch

from singularity.proxy.bootstrap._singularity_proxy import protocol

_SIOCOUTQ = 0x5411


def allocator_bytes(count: float) -> str:
    """A byte count the way the CUDA allocator prints it in out-of-memory messages."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{int(count)} bytes"


class Connection:
    """One job process's socket; answers and control messages share its send lock."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()

    def send(self, msg: Any) -> None:
        """Send one message."""
        with self.lock:
            protocol.send_msg(self.sock, msg)

    def unread_bytes(self) -> int:
        """Bytes sent to the process that it has not read yet."""
        buf = fcntl.ioctl(self.sock.fileno(), _SIOCOUTQ, b"\0\0\0\0")
        return int(struct.unpack("i", buf)[0])


class DeviceMemory:
    """The device's capacity and the bytes all sessions on it hold."""

    def __init__(self, index: int, capacity: int) -> None:
        self.index = index
        self.capacity = capacity
        self.used = 0

    def free_bytes(self) -> int:
        """Bytes not held by any session."""
        return max(0, self.capacity - self.used)

    def out_of_memory(self, session: Session, asked: int) -> torch.OutOfMemoryError:
        """The error CUDA's allocator raises, with this device's figures."""
        return torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {allocator_bytes(asked)}. GPU {self.index} has a "
            f"total capacity of {allocator_bytes(self.capacity)} of which "
            f"{allocator_bytes(self.free_bytes())} is free. Of the allocated memory "
            f"{allocator_bytes(session.held_bytes)} is allocated by PyTorch, "
            "and 0 bytes is reserved by PyTorch but unallocated. If reserved but unallocated memory is "
            "large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
            "fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )


class Session:
    """Everything one job process (job id, rank) holds on this device."""

    def __init__(self, job_id: str, rank: int, uid: int, memory: DeviceMemory) -> None:
        self.job_id = job_id
        self.rank = rank
        self.uid = uid
        self.memory = memory
        self.tensors: dict[int, torch.Tensor] = {}
        self.storage_of: dict[int, int] = {}
        """Handle -> address of its storage."""
        self.storages: dict[int, list[int]] = {}
        """Storage address -> [bytes, number of handles using it]."""
        self.operators: dict[int, Any] = {}
        """Operator id -> the torch operator (OpOverload) it stands for."""
        self.operator_names: dict[int, tuple[str, str, str]] = {}
        """Operator id -> (namespace, name, overload), as saved in checkpoints."""
        self.held_bytes = 0
        self.peak_bytes = 0
        self.pending_error: tuple[str, str, str] | None = None
        """The first failure of an operation since the last answer, reported at the next request."""
        self.connection: Connection | None = None
        self.parked = False
        self.waiting = False
        """Whether the process was waiting for an answer when it parked."""
        self.parked_event = threading.Event()

    def add(self, handle: int, tensor: torch.Tensor) -> int:
        """Hold `tensor` under `handle`; the bytes of new storage this takes."""
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        self.tensors[handle] = tensor
        self.storage_of[handle] = address
        entry = self.storages.get(address)
        if entry is not None:
            entry[1] += 1
            return 0
        nbytes = storage.nbytes()
        self.storages[address] = [nbytes, 1]
        self.held_bytes += nbytes
        self.memory.used += nbytes
        if self.held_bytes > self.peak_bytes:
            self.peak_bytes = self.held_bytes
        return nbytes

    def free(self, handle: int) -> None:
        """Drop the tensor under `handle` (its storage when no other handle uses it)."""
        if self.tensors.pop(handle, None) is None:
            return
        address = self.storage_of.pop(handle)
        entry = self.storages[address]
        entry[1] -= 1
        if entry[1] == 0:
            del self.storages[address]
            self.held_bytes -= entry[0]
            self.memory.used -= entry[0]

    def free_all(self) -> None:
        """Drop every tensor of the session."""
        for handle in list(self.tensors):
            self.free(handle)

    def check_capacity(self, new_handles: list[int], asked: int) -> None:
        """Undo the new tensors and raise CUDA's out-of-memory error if the device is over capacity."""
        if self.memory.used <= self.memory.capacity:
            return
        for handle in new_handles:
            self.free(handle)
        raise self.memory.out_of_memory(self, asked)
