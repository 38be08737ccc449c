"""Everything the in-job client, the proxy server and the daemon's control code agree on.

One home for the wire: framing, message kinds, operation and request kinds inside a batch,
output-template tags, the device marker, the descriptor numbers of job connections, the
conversion of a host tensor to bytes and back, and the factories the server runs itself.
A change here changes both ends at once. The framing needs only the standard library (a
bare interpreter can speak it); the tensor conversions import torch when first used.

A connection carries length-prefixed messages. Each message is a tuple whose first element
is its kind.

Job process -> server:
    (HELLO, job_id, rank, device_index, resume)  first message; `resume` re-attaches a
        restored process to the session the server already holds for (job_id, rank)
    (BATCH, ops, request)  operations to run in order, then `request` (or None); the
        server answers a request with exactly one REPLY or ERROR, and nothing otherwise
    (PARKED, waiting)  the process stopped at an operation boundary after a PARK;
        `waiting` says whether it was waiting for a reply at that moment

Server -> job process:
    (WELCOME, info)  the hello was accepted; `info` describes the device (DEVICE_INFO_KEYS)
    (REPLY, value)  the answer to the batch's request
    (ERROR, module, qualname, message)  the request (or an earlier operation of the
        session) raised this exception; the client raises the same type in the program
    (PARK,)  stop sending and answer PARKED; nothing is sent until RESUME
    (RESUME,)  go on

Daemon -> server, on the control socket (see proxy/control.py and the server's control):
    (name, *arguments) with name one of CONTROL_REQUESTS; answered by
    (CONTROL_OK, result) or (CONTROL_FAILED, exception type name, message)
"""

from __future__ import annotations

import pickle
import socket
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FD_BASE = 1000
"""A job process keeps its connection to device i at file descriptor FD_BASE + i."""

FD_SPAN = 256
"""Descriptors FD_BASE .. FD_BASE + FD_SPAN - 1 are reserved for proxy connections."""

DEVICE_MARKER = "\x00sing-device"
"""Stands for "the server's own device" wherever a torch.device appears in arguments."""

# -- framing ---------------------------------------------------------------------------------
LENGTH = struct.Struct("<Q")
"""Every message is preceded by its length in bytes."""
PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL

# -- message kinds: job process -> server ----------------------------------------------------
HELLO = "hello"
BATCH = "b"
PARKED = "p"

# -- message kinds: server -> job process ----------------------------------------------------
WELCOME = "w"
REPLY = "r"
ERROR = "e"
PARK = "P"
RESUME = "R"

# -- operations inside a batch: (kind, ...) ----------------------------------------------------
OP_CALL = 0
"""(OP_CALL, op_id, first_output_handle, args, kwargs): run a defined operator; its new output
tensors get consecutive handles from first_output_handle on."""
OP_DEFINE = 1
"""(OP_DEFINE, op_id, (namespace, name, overload)): op_id stands for this operator from now on."""
OP_FREE = 2
"""(OP_FREE, [handle, ...]): the job dropped these tensors."""
OP_UPLOAD = 3
"""(OP_UPLOAD, handle, dtype, shape, stride, raw bytes): a new tensor with these values."""
OP_FACTORY = 4
"""(OP_FACTORY, handle, torch function name, args, kwargs): a new tensor made by one of
SERVER_FACTORIES on the server's device."""
OP_FILL = 5
"""(OP_FILL, handle, dtype, shape, stride, raw bytes): copy these values into the tensor."""

# -- requests: the last element of a BATCH, answered with one REPLY or ERROR -----------------------
REQ_CALL = 0
"""(REQ_CALL, op_id, first_output_handle, args, kwargs) -> the output template."""
REQ_FETCH = 1
"""(REQ_FETCH, handle) -> (dtype, shape, stride, raw bytes) of the tensor's values."""
REQ_SYNC = 2
"""(REQ_SYNC,) -> None once everything sent before it has run."""
REQ_MEMORY = 3
"""(REQ_MEMORY, what) -> the session's memory figure `what`, one of MEMORY_QUERIES."""

MEMORY_ALLOCATED = "allocated"  # -> bytes the session holds
MEMORY_PEAK = "peak"  # -> the most bytes it held since the last reset
MEMORY_RESET_PEAK = "reset_peak"  # -> None; the peak becomes the current figure
MEMORY_INFO = "info"  # -> (free bytes on the device, capacity)
MEMORY_STATS = "stats"  # -> a dict like torch.cuda.memory_stats()
MEMORY_QUERIES = (MEMORY_ALLOCATED, MEMORY_PEAK, MEMORY_RESET_PEAK, MEMORY_INFO, MEMORY_STATS)

# -- output templates: what an operation returned, in the REPLY to REQ_CALL ------------------------
TEMPLATE_TENSOR = "T"
"""(TEMPLATE_TENSOR, (shape, stride, storage_offset, dtype), bytes of new storage): a new tensor,
which takes the next handle."""
TEMPLATE_ALIAS = "A"
"""(TEMPLATE_ALIAS, i): the operation returned its i-th tensor input itself."""
TEMPLATE_LIST = "L"
"""(TEMPLATE_LIST, [template, ...])."""
TEMPLATE_TUPLE = "U"
"""(TEMPLATE_TUPLE, [template, ...])."""
TEMPLATE_NONE = "N"
"""(TEMPLATE_NONE,)."""
TEMPLATE_VALUE = "V"
"""(TEMPLATE_VALUE, value): a plain value (number, bool, string; anything else as its repr)."""

# -- control channel ---------------------------------------------------------------------------
CONTROL_REQUESTS = ("quiesce", "save", "release", "load", "resume", "status")
CONTROL_OK = "ok"
CONTROL_FAILED = "err"

DEVICE_INFO_KEYS = ("name", "total_memory", "major", "minor", "multi_processor_count", "kind", "index")
"""What WELCOME tells a job process about its device."""

SERVER_FACTORIES = (
    "zeros", "ones", "empty", "full", "eye", "arange", "linspace", "logspace", "empty_strided",
)  # fmt: skip
"""torch functions a job may ask the server to run with OP_FACTORY (the tensor is made there)."""


def send_msg(sock: socket.socket, msg: Any) -> None:
    """Send one length-prefixed message."""
    data = pickle.dumps(msg, PICKLE_PROTOCOL)
    sock.sendall(LENGTH.pack(len(data)) + data)


def recv_exact(sock: socket.socket, size: int) -> bytes:
    """Read exactly `size` bytes; ConnectionError when the peer closes first."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        count = sock.recv_into(view[got:], size - got)
        if count == 0:
            raise ConnectionError("proxy connection closed")
        got += count
    return bytes(buf)


def recv_frame(sock: socket.socket) -> bytes:
    """The body of the next message, still encoded."""
    (size,) = LENGTH.unpack(recv_exact(sock, LENGTH.size))
    return recv_exact(sock, size)


def recv_msg(sock: socket.socket) -> Any:
    """Receive one message from a trusted peer; ConnectionError at end of stream."""
    return pickle.loads(recv_frame(sock))


# -- tensors as bytes --------------------------------------------------------------------------
def tensor_to_raw(tensor: torch.Tensor) -> tuple[torch.Tensor, bytes]:
    """A dense host copy of `tensor` (same strides where it is dense) and the bytes of its storage."""
    import torch

    copy = torch.empty_like(tensor, device="cpu")
    copy.copy_(tensor)
    return copy, storage_bytes(copy)


def storage_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of a host tensor's whole storage."""
    import torch

    flat = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    return flat.numpy().tobytes()


def tensor_from_raw(
    dtype: torch.dtype, shape: Sequence[int], stride: Sequence[int], raw: bytes
) -> torch.Tensor:
    """A host tensor over a copy of `raw`, the bytes of a storage, with this shape and stride."""
    import torch

    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return torch.empty(0, dtype=dtype).set_(buf.untyped_storage(), 0, shape, stride)
