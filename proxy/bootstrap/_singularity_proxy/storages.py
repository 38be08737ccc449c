"""What a program learns of a stand-in's storage: its size and, as on a GPU, an address.

Libraries compare storages by address and size (safetensors and Hugging Face find tied weights
so, FSDP checks that a tensor still views its storage). A storage's record is shared by a
stand-in and its views (tensor.py shares it when an operator's schema says its output views an
argument, and on `detach`); its address is given when first asked, never to another storage.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from . import protocol


class StandIn(Protocol):
    """What this module reads of a stand-in (tensor.py's ProxyTensor, which imports this module)."""

    _meta: tuple[Any, ...]
    _storage: StorageRecord
    _channel: Any
    _handle: Any

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...


ADDRESS_BASE = 1 << 44
"""Where the addresses stand-ins' storages report (`data_ptr`) begin, as a GPU's do, above 0."""
ADDRESS_SPACING = 1 << 30
"""The unit, and the least gap, of the address ranges given to storages."""


class StorageRecord:
    """What the client knows of one device storage, shared by a stand-in and its views: its size
    in bytes and, once asked for, the address it has in this process (as a GPU's `data_ptr`).

    Views of fresh tensors are made at almost every operation, so a record is cheap to make: its
    size is worked out from the layout it was made with (`meta`) only when asked or resized."""

    __slots__ = ("_address", "_meta", "_nbytes")
    _next_address = ADDRESS_BASE

    def __init__(self, meta: tuple[Any, ...]) -> None:
        self._meta = meta
        self._nbytes = -1
        self._address = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the storage: as last resized, else what the layout it was made with spans."""
        if self._nbytes < 0:
            shape, stride, offset, dtype = self._meta
            self._nbytes = int(protocol.storage_extent(shape, stride, offset) * dtype.itemsize)
        return self._nbytes

    @nbytes.setter
    def nbytes(self, value: int) -> None:
        self._nbytes = value

    def address(self) -> int:
        """Where the storage begins: given when first asked, never given to another storage.

        A storage's range is followed by at least ADDRESS_SPACING bytes nobody else has, so that
        storages grown later (FSDP's unsharded parameters) stay apart from the others.
        """
        if not self._address:
            self._address = StorageRecord._next_address
            span = -(-max(self.nbytes, 1) // ADDRESS_SPACING) * ADDRESS_SPACING
            StorageRecord._next_address += span + ADDRESS_SPACING
        return self._address


def storage_record(stand_in: StandIn) -> StorageRecord:
    """The record of the storage a stand-in views (made for it when it has none yet)."""
    record: StorageRecord | None = vars(stand_in).get("_storage")  # no exception on a miss
    if record is None:
        record = stand_in._storage = StorageRecord(stand_in._meta)
    return record


def viewed_argument(func: Any) -> int | None:
    """The position of the argument whose storage the operator's outputs view (None: new ones)."""
    for position, argument in enumerate(func._schema.arguments):
        info = argument.alias_info
        if info is not None and not info.is_write and info.before_set:
            return position
    return None


class StandInStorage:
    """What both forms of a stand-in's storage have: its address in this process (`data_ptr`,
    which safetensors and Hugging Face compare to find tied weights) and its device."""

    def __init__(self, stand_in: StandIn) -> None:
        self.stand_in = stand_in

    def data_ptr(self) -> int:
        """The storage's address in this process (the same for every view of it)."""
        return storage_record(self.stand_in).address()

    @property
    def device(self) -> torch.device:
        return self.stand_in.device

    @property
    def is_cuda(self) -> bool:
        return True

    def is_shared(self) -> bool:
        """True, as for any CUDA storage (processes share it by CUDA IPC, not shared memory)."""
        return True

    _is_shared = is_shared

    def share_memory_(self) -> StandInStorage:
        """Nothing to do, as for a CUDA storage (`Tensor.share_memory_`, `Module.share_memory`)."""
        return self

    _share_memory_ = share_memory_

    def is_pinned(self, device: Any = "cuda") -> bool:
        """False: only host memory is pinned."""
        return False


class ProxyStorage(StandInStorage):
    """What `untyped_storage()` gives for a stand-in: its size, and resizing (FSDP frees and
    re-allocates the storage of its unsharded parameters this way)."""

    def size(self) -> int:
        """Bytes of the storage (as last resized, else what the layout of the stand-in it was made
        for spans)."""
        return storage_record(self.stand_in).nbytes

    nbytes = size
    __len__ = size

    def resize_(self, nbytes: int) -> ProxyStorage:
        """Resize the storage on the device (the tensor keeps its shape; its views share the storage)."""
        stand_in = self.stand_in
        stand_in._channel.push([protocol.OP_RESIZE_STORAGE, stand_in._handle.id, int(nbytes)])
        storage_record(stand_in).nbytes = int(nbytes)
        return self

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ProxyStorage):
            return NotImplemented
        return storage_record(self.stand_in) is storage_record(other.stand_in)

    def __hash__(self) -> int:
        return id(storage_record(self.stand_in))


class ProxyTypedStorage(StandInStorage):
    """What the deprecated `storage()` gives for a stand-in: its storage counted in elements of the
    stand-in's dtype (safetensors falls back to it), and resized so (FSDP1)."""

    def __init__(self, stand_in: StandIn) -> None:
        super().__init__(stand_in)
        self.dtype = stand_in.dtype

    def untyped(self) -> ProxyStorage:
        return ProxyStorage(self.stand_in)

    def element_size(self) -> int:
        return int(self.dtype.itemsize)

    def nbytes(self) -> int:
        return storage_record(self.stand_in).nbytes

    def size(self) -> int:
        return self.nbytes() // self.element_size()

    __len__ = size
    _size = size  # FSDP1 asks whether a flat parameter's storage is freed so

    def _resize_(self, size: int) -> None:
        """Resize the storage to `size` elements (FSDP1 frees and re-allocates its flat parameters'
        storages so)."""
        self.untyped().resize_(int(size) * self.element_size())

    resize_ = _resize_
