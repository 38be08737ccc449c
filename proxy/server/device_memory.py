"""The memory of the device a proxy server serves: its capacity, what its sessions hold (a
storage that several sessions share counted once), what squashing keeps, and what waiting ranks
moved to host memory; and the out-of-memory error CUDA's allocator would raise."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

import torch


class Holder(Protocol):
    """What holds storages on the device (session.Session): the bytes it holds."""

    held_bytes: int


HolderT = TypeVar("HolderT", bound=Holder)


def allocator_bytes(count: float) -> str:
    """A byte count the way the CUDA allocator prints it in out-of-memory messages."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{int(count)} bytes"


class DeviceMemory(Generic[HolderT]):
    """The device's capacity and the bytes all sessions on it hold (a storage that several sessions
    share, see dedup.py, counts once)."""

    def __init__(self, index: int, capacity: int) -> None:
        self.index = index
        self.capacity = capacity
        self.used = 0
        self.holders: dict[int, list[HolderT]] = {}
        """Storage identity -> the sessions using it (more than one: a deduplicated storage)."""
        self.shared = 0
        """Storages used by more than one session (0: nothing to copy before a write)."""
        self.copied_bytes = 0
        """Bytes copied so far because a session wrote a storage it shared."""
        self.peak = 0
        """The most bytes held at once since the server started."""
        self.values: dict[int, int] = {}
        """Storage identity -> its value id, while squashing follows it (squash.py); dropped when
        the storage is let go, so an identity reused by a new storage never inherits one."""
        self.kept: dict[int, tuple[torch.UntypedStorage, int]] = {}
        """Storage identity -> (storage, bytes) of storages no session holds any more, kept and
        counted while squashing may still hand them to another session of the job: what one
        replica made and freed before the others ran the same operation."""
        self.kept_bytes = 0
        """Bytes of the kept storages: counted against the capacity (and let go when an
        allocation needs them), not as what the jobs hold."""
        self.keeps: Callable[[int], bool] | None = None
        """Whether squashing wants a storage its last holder lets go (set by squash.py)."""
        self.swapped_bytes = 0
        """Bytes of storages moved to host memory while their sessions wait (not in `used`)."""
        self.swapped_total = 0
        """Bytes moved to host memory so far."""
        self.being_read: Counter[int] = Counter()
        """Storage identity -> saves reading it beside the job's operations (a checkpoint's
        pre-copy): such a storage stays where it is until read (Session.swap_out), since moving it
        would leave the reader an emptied or freed storage."""

    def begin_reading(self, keys: Iterable[int]) -> None:
        """A save reads these storages beside the job's operations: keep them where they are."""
        self.being_read.update(keys)

    def end_reading(self, keys: Iterable[int]) -> None:
        """A save is done reading these storages."""
        for key in keys:
            self.being_read[key] -= 1
            if self.being_read[key] <= 0:
                del self.being_read[key]

    def moved_off(self, nbytes: int) -> None:
        """Count a storage's bytes moved to host memory."""
        self.used -= nbytes
        self.swapped_bytes += nbytes
        self.swapped_total += nbytes

    def moved_back(self, nbytes: int) -> None:
        """Count a storage's bytes back on the device."""
        self.dropped_off(nbytes)
        self.peak = max(self.peak, self.used - self.kept_bytes)

    def dropped_off(self, nbytes: int) -> None:
        """Count the bytes of a storage let go while in host memory back in `used`, for `let_go`
        to take them out."""
        self.used += nbytes
        self.swapped_bytes -= nbytes

    def hold(self, key: int, nbytes: int, session: HolderT) -> None:
        """Count a session's use of a storage (its bytes once, however many sessions use it)."""
        holders = self.holders.get(key)
        if holders is None:
            self.holders[key] = [session]
            kept = self.kept.pop(key, None)
            if kept is not None:
                self.kept_bytes -= kept[1]  # counted in `used` while kept
            else:
                self.values.pop(key, None)  # an identity last used by a storage held by no one here
                self.used += nbytes
            self.peak = max(self.peak, self.used - self.kept_bytes)
            return
        holders.append(session)
        if len(holders) == 2:
            self.shared += 1

    def let_go(
        self, key: int, nbytes: int, session: HolderT, storage: torch.UntypedStorage | None = None
    ) -> None:
        """Forget a session's use of a storage (its bytes when no session uses it any more, unless
        squashing keeps `storage` for another session)."""
        holders = self.holders[key]
        holders.remove(session)
        if not holders:
            del self.holders[key]
            if storage is not None:  # squashing keeps it (Session._if_kept)
                self.kept[key] = (storage, nbytes)
                self.kept_bytes += nbytes
                return
            self.values.pop(key, None)
            self.used -= nbytes
        elif len(holders) == 1:
            self.shared -= 1

    def release(self, key: int) -> None:
        """Let a kept storage go (squashing no longer wants it)."""
        found = self.kept.pop(key, None)
        if found is not None:
            self.values.pop(key, None)
            self.used -= found[1]
            self.kept_bytes -= found[1]

    def room_for(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit on the device, letting the kept storages go if that is what
        it takes (they only save squashed sessions a run of an operation)."""
        if self.used + nbytes <= self.capacity:
            return True
        for key in list(self.kept):
            self.release(key)
        return self.used + nbytes <= self.capacity

    def is_shared(self, key: int) -> bool:
        """Whether more than one session uses the storage."""
        return self.shared > 0 and len(self.holders.get(key, ())) > 1

    def free_bytes(self) -> int:
        """Bytes not held by any session (kept storages count as free: they go when needed)."""
        return max(0, self.capacity - self.used + self.kept_bytes)

    def out_of_memory(self, session: HolderT, asked: int) -> torch.OutOfMemoryError:
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
