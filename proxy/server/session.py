"""What one job process holds on a device.

A session is keyed by (job id, rank, logical device). It owns the process's tensors by handle, the operators
the process defined, its memory figures, the first error of an operation not yet reported,
and its park state. Memory is counted per storage (views share their base's bytes), per
session and for the whole device (device_memory.py), whose capacity is what the program sees as
total memory.
"""

from __future__ import annotations

import fcntl
import itertools
import socket
import struct
import threading
from collections.abc import Sequence
from typing import Any

import torch

from singularity.proxy.bootstrap._singularity_proxy import protocol
from singularity.proxy.bootstrap._singularity_proxy.protocol import ProtocolError

from . import operators
from .device_memory import DeviceMemory
from .plans import Plan
from .statefile import storage_bytes

_SIOCOUTQ = 0x5411
_STORAGE_MARKS = itertools.count(1)
"""Numbers that tell apart every (storage, tensors sharing its version counter) ever held."""


class ReportedFailure(Exception):
    """A failure already described as [module, qualified name, message] for an ERROR message."""

    def __init__(self, info: list[str]) -> None:
        super().__init__(info[2])
        self.info = info


class JobNotHere(LookupError):
    """A control request names a job that had sessions on this device and has none left: its
    processes ended."""


def error_message(error: BaseException) -> str:
    """An exception's own text, without the quotes str() puts around a KeyError's key."""
    if isinstance(error, KeyError):
        return str(error.args[0]) if error.args else ""
    return str(error)


def exception_info(error: BaseException) -> list[str]:
    """[module, qualified name, message] of an exception, as sent in an ERROR message.

    Protocol errors are named by the job's own module path, so the job raises the same class.
    """
    if isinstance(error, ReportedFailure):
        return error.info
    message = error_message(error)
    if isinstance(error, ProtocolError):
        return ["_singularity_proxy.protocol", "ProtocolError", f"proxy: {message}"]
    # the server's own exception classes travel as their nearest standard base class
    kind = next(k for k in type(error).__mro__ if not k.__module__.startswith("singularity."))
    return [kind.__module__, kind.__qualname__, message]


_SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}
"""The dense components of a sparse tensor, by layout, as its methods' names."""


def sparse_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The dense tensors a sparse tensor is made of (indices, values); [] for a strided tensor."""
    names = _SPARSE_PARTS.get(tensor.layout, ())
    return [getattr(tensor, name)() for name in names]


_CAN_HAND_OVER = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def in_host_memory(storage: torch.UntypedStorage) -> bool:
    """Whether a storage's bytes already lie in host memory (a virtual device's), so that moving
    them to host memory and back hands the same bytes over instead of copying them."""
    return storage.device.type == "cpu" and _CAN_HAND_OVER


def _hand_over(holder: torch.UntypedStorage, empty: torch.UntypedStorage) -> None:
    """Give a storage's bytes (its memory, unmoved) to an empty storage on the same device."""
    holder._swap_data_ptr_(empty)  # type: ignore[attr-defined]


def storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding a tensor's data: its own, or its components' if it is sparse."""
    if tensor.layout == torch.strided:
        return [tensor.untyped_storage()]
    return [part.untyped_storage() for part in sparse_parts(tensor)]


def rebindable(tensor: torch.Tensor) -> bool:
    """Whether a tensor can be moved onto another storage holding the same bytes (dedup.py)."""
    return tensor.layout == torch.strided and not tensor.is_inference() and not tensor.is_quantized


class Connection:
    """One job process's socket; answers and control messages share its send lock."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()

    def send(self, kind: int, value: Any = None) -> None:
        """Send one message (see protocol.py)."""
        with self.lock:
            protocol.send_message(self.sock, kind, value)

    def unread_bytes(self) -> int:
        """Bytes sent to the process that it has not read yet."""
        buf = fcntl.ioctl(self.sock.fileno(), _SIOCOUTQ, b"\0\0\0\0")
        return int(struct.unpack("i", buf)[0])


SessionKey = tuple[str, int, int, int]
"""(job id, rank, logical device, pid of the process holding it)."""
UNKNOWN_DEVICE = -1
"""The logical device of a session restored from a file that did not name it (the rank's only one)."""


class Session:
    """Everything one job process (job id, rank, which process of the rank) holds on this device
    through one of the devices it sees (`index`, its cuda:index): a process whose cuda:0 and cuda:1
    are both served here has a session for each, as on two GPUs, and two processes of a rank on one
    device have a session each, as two processes on one GPU."""

    def __init__(
        self,
        job_id: str,
        rank: int,
        uid: int,
        memory: DeviceMemory[Session],
        index: int = 0,
        process: int = 0,
    ) -> None:
        self.job_id = job_id
        self.rank = rank
        self.index = index
        self.process = process
        """The pid of the process that holds it (0 in checkpoints from before processes were told
        apart): a rank's processes each have their own sessions."""
        self.uid = uid
        self.memory = memory
        self.tensors: dict[int, torch.Tensor] = {}
        self.storage_of: dict[int, tuple[int, ...]] = {}
        """Handle -> identities of its storages (views share their base's; a sparse tensor has
        one per component)."""
        self.storages: dict[int, list[int]] = {}
        """Storage identity -> [bytes, number of handles using it]."""
        self.handles_on: dict[int, set[int]] = {}
        """Storage identity -> the handles using it."""
        self.operators: dict[int, operators.Served] = {}
        """Operator id -> the served operator it stands for."""
        self.operator_names: dict[int, tuple[str, str, str]] = {}
        """Operator id -> (namespace, name, overload), as saved in checkpoints."""
        self.refused: dict[int, operators.RefusedOperator] = {}
        """Operator id -> why the server refused to define it."""
        self.plans: dict[int, Plan] = {}
        """Plan id -> a call planned by the job (see plans.py)."""
        self.plan_wire: dict[int, list[Any]] = {}
        """Plan id -> [op_id, args, kwargs] as the job sent it, as saved in checkpoints."""
        self.plan_leaves = 0
        self.held_bytes = 0
        self.peak_bytes = 0
        self.settings: dict[str, Any] | None = None
        """The process's numeric settings (protocol.OP_SETTINGS), its operations run with; None:
        torch's own, the server's."""
        self.pending_error: list[str] | None = None
        """The first failure of an operation since the last answer, reported at the next request."""
        self.connection: Connection | None = None
        self.park_asked = False
        """Whether the daemon asked the process to park (only then is PARKED taken)."""
        self.parked = False
        self.connected_when_parked = True
        """Whether its process was still connected when the daemon parked the job: a checkpoint
        then holds the connection (to be reconnected on restore) rather than a dead one."""
        self.retiring = False
        """Whether a thread is retiring the session (its process ended: service.Server.retire)."""
        self.waiting = False
        """Whether the process was waiting for an answer when it parked."""
        self.parked_event = threading.Event()
        self.parked_at = 0.0
        """When the process last parked, by CLOCK_MONOTONIC (one clock for every process here)."""
        self.resumed_at = 0.0
        """When the server last let the process go on after parking (same clock)."""
        self.led = False
        """Whether the session just ran an operation on storages it shares with other ranks here,
        whose result they will be squashed onto (pace.py)."""
        self.shrunk_storages = False
        """Whether the job resized a storage smaller: from then on the tensors an operation uses are
        checked against their storages' bytes first (executor.py)."""
        self.swapped: dict[int, torch.Tensor] = {}
        """Storage identity -> its bytes in host memory, for a storage moved off the device while
        the session waits in a collective (the device storage keeps its identity at no bytes;
        whatever next uses it brings it back: `swap_in`)."""
        self.read_on_host: set[int] = set()
        """Storages moved off whose host bytes a collective was given to read (`readable`): handing
        those bytes back to the device would pull them from under that reader, so they are copied."""
        self.storage_marks: dict[int, int] = {}
        """Storage identity -> a number renewed whenever a tensor that may not share the storage's
        version counter starts using it (a new storage, an alias that is not a view): with the
        tensors' version counters it tells a pre-copy whether the bytes may have changed."""

    # -- what the job refers to -------------------------------------------------------------------

    @property
    def key(self) -> SessionKey:
        """(job id, rank, logical device, process): what the server holds the session under."""
        return (self.job_id, self.rank, self.index, self.process)

    def tensor(self, handle: Any) -> torch.Tensor:
        """The tensor the session holds under `handle`; ProtocolError if it holds none."""
        found = self.tensors.get(handle) if type(handle) is int else None
        if found is None:
            raise ProtocolError(f"no tensor {handle!r} in this session")
        return found

    def claim_handle(self, handle: Any) -> None:
        """Check that `handle` is free for a new tensor; ProtocolError if not."""
        if type(handle) is not int or handle < 0 or handle in self.tensors:
            raise ProtocolError(f"handle {handle!r} cannot take a new tensor")

    def define(self, op_id: int, namespace: Any, name: Any, overload: Any) -> None:
        """Let `op_id` stand for the operator namespace::name.overload, if the server serves it.

        A refused operator stays refused under its id: every call names the reason.
        """
        if not all(type(part) is str for part in (namespace, name, overload)):
            raise ProtocolError("an operator name is three strings")
        self.operators.pop(op_id, None)
        try:
            self.operators[op_id] = operators.serve(namespace, name, overload)
        except operators.RefusedOperator as refused:
            self.refused[op_id] = refused
            raise
        self.refused.pop(op_id, None)
        self.operator_names[op_id] = (namespace, name, overload)

    def operator(self, op_id: Any) -> operators.Served:
        """The operator `op_id` stands for; why not if it was refused or never defined."""
        found = self.operators.get(op_id) if type(op_id) is int else None
        if found is None:
            refused = self.refused.get(op_id) if type(op_id) is int else None
            if refused is not None:
                raise operators.RefusedOperator(*refused.args)
            raise ProtocolError(f"operator {op_id!r} was not defined")
        return found

    def plan(self, plan_id: Any, op_id: Any, args: Any, kwargs: Any, device: torch.device) -> None:
        """Let `plan_id` stand for a call of operator `op_id` with these arguments (slots marked)."""
        protocol.integer(plan_id, 0, protocol.PLAN_LIMIT - 1)
        old = self.plans.pop(plan_id, None)
        self.plan_wire.pop(plan_id, None)
        if old is not None:
            self.plan_leaves -= old.leaves
        made = Plan(self.operator(op_id), args, kwargs, device)
        if self.plan_leaves + made.leaves > protocol.PLAN_LEAVES:
            raise ProtocolError("the session's plans are too large")
        self.plan_leaves += made.leaves
        self.plans[plan_id] = made
        self.plan_wire[plan_id] = [op_id, args, kwargs]

    def planned(self, plan_id: Any) -> Plan:
        """The plan `plan_id` stands for; ProtocolError if there is none."""
        found = self.plans.get(plan_id) if type(plan_id) is int else None
        if found is None:
            raise ProtocolError(f"plan {plan_id!r} was not made")
        return found

    def restore_plans(self, saved: dict[Any, Any], device: torch.device) -> None:
        """Make again the plans of a checkpoint (`plan_wire` of the saved session)."""
        for plan_id, (op_id, args, kwargs) in saved.items():
            self.plan(int(plan_id), op_id, args, kwargs, device)

    # -- errors reported at the next request ------------------------------------------------------
    def fail(self, error: BaseException) -> None:
        """Remember the first failure of an operation since the last answer."""
        if self.pending_error is None:
            self.pending_error = exception_info(error)

    def raise_pending(self) -> None:
        """Raise the remembered failure (once), if any."""
        if self.pending_error is not None:
            info, self.pending_error = self.pending_error, None
            raise ReportedFailure(info)

    # -- memory -----------------------------------------------------------------------------------
    def check_room(self, nbytes: int) -> None:
        """Raise CUDA's out-of-memory error, before allocating, if `nbytes` more do not fit."""
        if not self.memory.room_for(nbytes):
            raise self.memory.out_of_memory(self, nbytes)

    def add(self, handle: int, tensor: torch.Tensor) -> int:
        """Hold `tensor` under `handle`; the bytes of new storage this takes."""
        self.tensors[handle] = tensor
        keys = []
        added = 0
        for storage in storages(tensor):
            key = storage._cdata  # the storage itself: stays the same when it is resized
            keys.append(key)
            entry = self.storages.get(key)
            if entry is not None:
                entry[1] += 1
                self.handles_on[key].add(handle)
                if not tensor._is_view():
                    self.storage_marks[key] = next(_STORAGE_MARKS)
                if not rebindable(tensor) and self.memory.is_shared(key):
                    self._keep_alone(key, storage)
                continue
            nbytes = storage.nbytes()
            self.storages[key] = [nbytes, 1]
            self.handles_on[key] = {handle}
            self.storage_marks[key] = next(_STORAGE_MARKS)
            self.memory.hold(key, nbytes, self)
            added += nbytes
        self.storage_of[handle] = tuple(keys)
        self.held_bytes += added
        if self.held_bytes > self.peak_bytes:
            self.peak_bytes = self.held_bytes
        return added

    def recount(self, handle: int) -> int:
        """Count a tensor's storage again after an operation that may have resized it; the growth."""
        growth = 0
        for key, storage in zip(self.storage_of[handle], storages(self.tensors[handle]), strict=False):
            entry = self.storages[key]
            nbytes = storage.nbytes()
            growth += nbytes - entry[0]
            entry[0] = nbytes
        if growth:
            self.held_bytes += growth
            self.memory.used += growth  # a storage is copied before a write that resizes it: not shared
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return growth

    def rebind(self, handle: int) -> None:
        """Count a tensor under its current storage, after an operation that may have replaced it."""
        tensor = self.tensors[handle]
        if tuple(storage._cdata for storage in storages(tensor)) != self.storage_of[handle]:
            self.free(handle)
            self.add(handle, tensor)

    def free(self, handle: int) -> None:
        """Drop the tensor under `handle` (its storages when no other handle uses them)."""
        tensor = self.tensors.pop(handle, None)
        if tensor is None:
            return
        for key in self.storage_of.pop(handle):
            entry = self.storages[key]
            entry[1] -= 1
            self.handles_on[key].discard(handle)
            if entry[1] == 0:
                del self.storages[key]
                del self.handles_on[key]
                self.storage_marks.pop(key, None)
                self.held_bytes -= entry[0]
                if self._forget_swapped(key):
                    self.memory.let_go(key, entry[0], self)
                else:
                    self.memory.let_go(key, entry[0], self, self._if_kept(tensor, key))

    # -- storages shared with other sessions (dedup.py) --------------------------------------------
    def repoint(self, key: int, storage: torch.UntypedStorage) -> None:
        """Let every tensor using storage `key` use `storage` instead (which holds the same bytes,
        or the result of an operation the session ran apart from the others: executor.py).

        The tensors stay the same objects (their layout unchanged), so whatever refers to them
        sees the new storage; their version counters move, so a pre-copy copies them again.
        """
        new_key = storage._cdata
        handles = self.handles_on.pop(key)
        nbytes, count = self.storages.pop(key)
        self.storage_marks.pop(key, None)
        swapped = self._forget_swapped(key)
        old = self._if_kept(self.tensors[next(iter(handles))], key) if handles and not swapped else None
        with torch.no_grad():
            for handle in handles:
                tensor = self.tensors[handle]
                tensor.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())
                self.storage_of[handle] = tuple(new_key if k == key else k for k in self.storage_of[handle])
        self.storages[new_key] = [nbytes, count]
        self.handles_on[new_key] = handles
        self.storage_marks[new_key] = next(_STORAGE_MARKS)
        self.memory.hold(new_key, nbytes, self)
        self.memory.let_go(key, nbytes, self, old)

    def _if_kept(self, tensor: torch.Tensor, key: int) -> torch.UntypedStorage | None:
        """The tensor's storage `key` if squashing would keep it once no session holds it."""
        keeps = self.memory.keeps
        if keeps is None or not keeps(key):
            return None
        return next((storage for storage in storages(tensor) if storage._cdata == key), None)

    def own_copy(self, key: int, storage: torch.UntypedStorage) -> None:
        """Give the session its own copy of a storage it shares, before it writes there."""
        self.check_room(storage.nbytes())
        copy = torch.empty(storage.nbytes(), dtype=torch.uint8, device=storage.device)
        copy.copy_(storage_bytes(storage))  # unlike UntypedStorage.copy_, lets the other threads run
        self.memory.copied_bytes += storage.nbytes()
        self.repoint(key, copy.untyped_storage())

    def before_write(self, tensor: torch.Tensor) -> None:
        """Copy the storages of a tensor the session is about to write, where it shares them."""
        for storage in storages(tensor):
            key = storage._cdata
            if self.memory.is_shared(key) and key in self.storages:
                self.own_copy(key, storage)

    def _keep_alone(self, key: int, storage: torch.UntypedStorage) -> None:
        """Move the other sessions off a shared storage that one of this session's tensors uses
        but cannot leave (a sparse or inference tensor): its writes then reach no one else."""
        for other in list(self.memory.holders[key]):
            if other is not self:
                other.own_copy(key, storage)

    # -- storages moved to host memory while the session waits (collectives.py) --------------------
    def storage(self, key: int) -> torch.UntypedStorage:
        """The storage `key` the session holds."""
        tensor = self.tensors[next(iter(self.handles_on[key]))]
        return next(storage for storage in storages(tensor) if storage._cdata == key)

    def swap_out(self, key: int) -> bool:
        """Move a storage's bytes to host memory and give its device memory back; whether it could
        (a storage the allocator does not own cannot give its memory back, and one a save is reading
        stays: DeviceMemory.being_read)."""
        if self.memory.being_read[key]:
            return False
        storage = self.storage(key)
        if not storage.resizable():
            return False
        nbytes = self.storages[key][0]
        if in_host_memory(storage):
            host = torch.empty(0, dtype=torch.uint8)
            _hand_over(storage, host.untyped_storage())
            host.set_(host.untyped_storage(), 0, (nbytes,), (1,))
        else:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
            host.copy_(storage_bytes(storage))
            storage.resize_(0)
        self.swapped[key] = host
        self.memory.moved_off(nbytes)
        return True

    def swap_in(self, key: int, keep_bytes: bool = True) -> None:
        """Bring a storage moved to host memory back to the device (without its old bytes when
        the caller overwrites all of them)."""
        host = self.swapped[key]
        nbytes = host.numel()
        self.check_room(nbytes)
        storage = self.storage(key)
        if in_host_memory(storage) and key not in self.read_on_host:
            _hand_over(host.untyped_storage(), storage)
        else:
            storage.resize_(nbytes)
            if keep_bytes:
                storage_bytes(storage).copy_(host)
        del self.swapped[key]
        self.read_on_host.discard(key)
        self.memory.moved_back(nbytes)

    def swap_in_all(self) -> None:
        """Bring every storage of the session back to the device."""
        for key in list(self.swapped):
            self.swap_in(key)

    def swap_in_tensors(self, values: list[Any]) -> None:
        """Bring the storages of the tensors among these values back to the device, where they were
        moved off."""
        for tensor in values:
            if not isinstance(tensor, torch.Tensor):
                continue
            for storage in storages(tensor):
                if storage._cdata in self.swapped:
                    self.swap_in(storage._cdata)

    def swap_in_overwritten(self, tensor: torch.Tensor, others: Sequence[Any] = ()) -> None:
        """Bring back a tensor about to be overwritten, without its old bytes where it covers its
        storage and none of the `others` (what the write reads) uses that storage."""
        key = tensor.untyped_storage()._cdata
        if key not in self.swapped:
            return
        read = any(
            isinstance(other, torch.Tensor) and key in {s._cdata for s in storages(other)} for other in others
        )
        self.swap_in(key, keep_bytes=read or not self.covers_counted(tensor))

    def covers_counted(self, tensor: torch.Tensor) -> bool:
        """Whether a tensor's elements are every byte of its storage, each once, at the size the
        session counts (a storage in host memory keeps its size there)."""
        key = tensor.untyped_storage()._cdata
        whole = tensor.numel() * tensor.element_size() == self.storages[key][0]
        return whole and tensor.storage_offset() == 0 and tensor.is_contiguous()

    def readable(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor, or where its storage was moved to host memory the same layout over the host
        bytes (what a collective reads of a member that waits without bringing it back)."""
        key = tensor.untyped_storage()._cdata
        host = self.swapped.get(key) if self.swapped else None
        if host is None:
            return tensor
        self.read_on_host.add(key)
        view = torch.empty(0, dtype=tensor.dtype)
        return view.set_(host.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())

    def done_reading(self, tensor: torch.Tensor | None = None) -> None:
        """A collective no longer reads the host bytes `readable` gave it of this tensor (None:
        of any tensor): bringing them back may hand them over again."""
        if tensor is None:
            self.read_on_host.clear()
        else:
            self.read_on_host.discard(tensor.untyped_storage()._cdata)

    def _forget_swapped(self, key: int) -> bool:
        """Drop the host bytes of a storage the session lets go (counted back in `used` for
        `let_go`); whether it was on the host."""
        host = self.swapped.pop(key, None) if self.swapped else None
        self.read_on_host.discard(key)
        if host is None:
            return False
        self.memory.dropped_off(host.numel())
        return True

    def free_all(self) -> list[torch.Tensor]:
        """Drop every tensor of the session; they are returned, so that the caller may let their
        memory go later, off the lock (the counts are already down: freeing a large job's memory
        takes a tenth of a second per GiB)."""
        held = list(self.tensors.values())
        for handle in list(self.tensors):
            self.free(handle)
        return held

    def check_capacity(self, new_handles: list[int], asked: int) -> None:
        """Undo the new tensors and raise CUDA's out-of-memory error if the device is over capacity."""
        if self.memory.room_for(0):
            return
        for handle in new_handles:
            self.free(handle)
        raise self.memory.out_of_memory(self, asked)
