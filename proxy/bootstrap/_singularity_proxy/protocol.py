"""Everything the in-job client, the proxy server and the daemon's control code agree on.

One home for the wire: framing, message kinds, operation and request kinds inside a batch,
output templates, the value codec, the descriptor numbers of job connections, tensors as
bytes, and the factories the server runs itself. A change here changes both ends at once.
The framing and the codec need only the standard library (a bare interpreter can speak
them); torch is imported when a torch value is first encoded or decoded.

Frames
------
A frame is a header, a table of buffer lengths, a JSON body and the buffers:

    kind: u8, 0: u8, buffer count: u16, body length: u32      (FRAME_HEADER, little endian)
    buffer count x u64 lengths
    body: UTF-8 JSON
    the buffers, back to back (raw tensor bytes travel here, never inside the JSON)

Reading a frame can only yield data: JSON (lists, objects, strings, numbers, booleans,
null) and byte buffers. Where a Python value needs more than JSON has, the body holds a
one-key object, a *tag* (see `encode_value`): {"tuple": [...]}, {"bytes": i} (the i-th
buffer), {"complex": [re, im]}, {"dtype": "float32"}, {"layout": "strided"},
{"memory_format": "channels_last"}, {"dict": {...}}; operation arguments also use
{"handle": n} (a tensor the job holds on the server), {"tensor": [dtype, shape, stride, i]}
(a host tensor whose storage is buffer i), DEVICE_MARKER (the server's own device) and, in
plans, {"slot": kind} (a value each run of the plan gives).
Frames from a job are bounded (MAX_BODY_BYTES, MAX_BUFFERS, MAX_FRAME_BUFFER_BYTES);
larger uploads travel in chunks (OP_ALLOCATE, then OP_WRITE).

Messages (frame kind: body)
---------------------------
Job process -> server:
    HELLO: [job_id, rank, device_index, resume, process]  the first frame; `resume` re-attaches
        a restored process to the session the server holds for it; `process`, the process's pid
        (which a restore keeps), tells apart the processes of one rank (older clients: absent, 0)
    BATCH: [ops]  operations to run in order; never answered
    REQUEST: [ops, request]  operations, then one request, answered by exactly one REPLY
        or ERROR (also when the frame cannot be decoded)
    PARKED: [waiting]  stopped at an operation boundary after PARK; `waiting` says whether
        the process was waiting for an answer at that moment (the server has read every frame
        the process sent before it, and keeps the ones it has not run yet)
Server -> job process:
    WELCOME: info  the hello was accepted; `info` describes the device (DEVICE_INFO_KEYS)
    REPLY: value  the answer to the request (encoded with `encode_value`)
    ERROR: [module, qualname, message]  the request, or an operation of the session since the
        last answer, raised this exception; the client raises the same type in the program
    PARK: null  stop sending and answer PARKED; nothing is sent until RESUME
    RESUME: null  go on
    GOODBYE: [module, qualname, message]  the server closes this connection, and why
Server <-> server of the same job, on the links the daemon made (socketpairs; see COLLECTIVES):
    PEER_PLACE: [job_id, group, rank, device_index]  this rank's collectives of the group run
        on that device (sent once per rank and group, to every other server of the job)
    PEER_PIECE: [job_id, group, seq, key, dtype, shape, operator, numel]  one buffer: a part
        of the data of collective `seq` of the group (which part: `key`, see collectives.py)
    PEER_GONE: [job_id, rank, {group: last seq}]  the process of this rank ended; it took part
        in the collectives of each group up to `last seq` (those after will never complete)
Daemon <-> server, on the control socket (proxy/control.py and the server's control.py):
    each request is one marker byte sent with sendmsg, carrying the request's file descriptors
    (save, load and prepare carry the device-state file; the others none), then the frame
    CONTROL_REQUEST: [name, *arguments]  name one of CONTROL_REQUESTS
    CONTROL_OK: result    CONTROL_FAILED: [kind (CONTROL_JOB_NOT_HERE or CONTROL_ERROR), message]
"""

from __future__ import annotations

import ctypes
import json
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FD_BASE = 1000
"""A job process keeps its connection to device i at file descriptor FD_BASE + i."""

FD_SPAN = 256
"""Descriptors FD_BASE .. FD_BASE + FD_SPAN - 1 are reserved for proxy connections."""

# -- frames ---------------------------------------------------------------------------------------
FRAME_HEADER = struct.Struct("<BxHI")
BUFFER_LENGTH = struct.Struct("<Q")

MAX_BODY_BYTES = 16 << 20
"""Largest JSON body a server reads from a job (a batch of 128 operations is a few KiB)."""
MAX_BUFFERS = 4096
"""Most buffers in one frame from a job."""
CHUNK_BYTES = 32 << 20
"""Most buffer bytes the client puts in one frame; larger tensors travel in chunks."""
HOST_ARGUMENT_BYTES = CHUNK_BYTES // 4
"""Host tensors larger than this reach the server as uploaded tensors, not inside the operation."""
MAX_FRAME_BUFFER_BYTES = CHUNK_BYTES
"""Most buffer bytes a server reads in one frame from a job."""


class ProtocolError(ValueError):
    """A frame or message that does not follow the protocol."""


@dataclass(frozen=True)
class FrameLimits:
    """Bounds on a frame read from a peer that is not trusted."""

    body_bytes: int = MAX_BODY_BYTES
    buffers: int = MAX_BUFFERS
    buffer_bytes: int = MAX_FRAME_BUFFER_BYTES


JOB_FRAME_LIMITS = FrameLimits()
"""What a server accepts from a job process."""
PEER_FRAME_LIMITS = FrameLimits(buffers=1, buffer_bytes=1 << 40)
"""What a server accepts from another server of its job (a piece of a collective's data)."""

# -- message kinds --------------------------------------------------------------------------------
HELLO = 1
BATCH = 2
REQUEST = 3
PARKED = 4
WELCOME = 10
REPLY = 11
ERROR = 12
PARK = 13
RESUME = 14
GOODBYE = 15
CONTROL_REQUEST = 20
CONTROL_OK = 21
CONTROL_FAILED = 22
CONTROL_JOB_NOT_HERE = "job_not_here"
"""The kind of a failed control request for a job with nothing on the device (it ended, or never came)."""
CONTROL_ERROR = "error"
"""The kind of any other failed control request."""
PEER_PLACE = 30
PEER_PIECE = 31
PEER_GONE = 32
PEER_MESSAGES = frozenset((PEER_PLACE, PEER_PIECE, PEER_GONE))
"""Kinds a server sends to the other servers of its job."""
JOB_MESSAGES = frozenset((HELLO, BATCH, REQUEST, PARKED))
"""Kinds a job process may send."""

# -- operations inside a batch: [kind, ...] -------------------------------------------------------
OP_CALL = 0
"""[OP_CALL, op_id, first_output_handle, args, kwargs]: run a defined operator; its new output
tensors get consecutive handles from first_output_handle on. kwargs is an object or null."""
OP_DEFINE = 1
"""[OP_DEFINE, op_id, namespace, name, overload]: op_id stands for this operator from now on."""
OP_FREE = 2
"""[OP_FREE, [handle, ...]]: the job dropped these tensors."""
OP_UPLOAD = 3
"""[OP_UPLOAD, handle, dtype, shape, stride, buffer]: a new tensor whose storage is the buffer."""
OP_FACTORY = 4
"""[OP_FACTORY, handle, function name, args, kwargs]: a new tensor made on the server's device
by one of SERVER_FACTORIES."""
OP_FILL = 5
"""[OP_FILL, handle, dtype, shape, stride, buffer]: copy these values into the tensor."""
OP_ALLOCATE = 6
"""[OP_ALLOCATE, handle, dtype, shape, stride]: a new uninitialised tensor (filled by OP_WRITE)."""
OP_WRITE = 7
"""[OP_WRITE, handle, byte offset, buffer]: write bytes into the tensor's storage."""
OP_PLAN = 8
"""[OP_PLAN, plan_id, op_id, args, kwargs]: plan_id stands from now on for a call of a defined
operator with these arguments, in which {"slot": kind} marks a value each run gives (SLOT_*),
in order: positional arguments depth first, then keyword arguments. A plan_id may be planned
again (it then stands for the new call). The server decodes the arguments once."""
OP_RUN = 9
"""[OP_RUN, plan_id, first_output_handle, values]: run a plan with these slot values; new output
tensors get consecutive handles from first_output_handle on, as with OP_CALL."""
OP_RESIZE_STORAGE = 12
"""[OP_RESIZE_STORAGE, handle, bytes]: resize the storage under the tensor (its views see it), as
FSDP frees and re-allocates its unsharded parameters (`untyped_storage().resize_(n)`)."""
OP_SETTINGS = 13
"""[OP_SETTINGS, settings]: the process's numeric settings from now on (its default dtype, oneDNN's
float32 precisions; see numerics.py): the operations after it run with them, as its own would."""
OP_GROUP = 10
"""[OP_GROUP, group, rank, members]: the process takes part, as global rank `rank`, in the
process group named `group`, whose members are these global ranks in group-rank order."""
OP_COLLECTIVE = 11
"""[OP_COLLECTIVE, group, seq, operator, spec]: the process's collective number `seq` in the
group: `operator` names the c10d operator it stands for (one the server serves, see
server/operators.py COLLECTIVES) and `spec` its tensors and options (see COLLECTIVE_SPEC).
It runs in order with the operations around it, once every member has reached it."""

# -- requests: the last element of a REQUEST ------------------------------------------------------
REQ_CALL = 0
"""[REQ_CALL, op_id, first_output_handle, args, kwargs] -> the output template."""
REQ_FETCH = 1
"""[REQ_FETCH, handle] -> [dtype, shape, stride, bytes]: the tensor's values; for a sparse
tensor {"layout": name, "shape": [...], "coalesced": bool, "parts": [[dtype, shape, stride,
bytes], ...]}, its dense components (indices and values)."""
REQ_SYNC = 2
"""[REQ_SYNC] -> null once everything sent before it has run."""
REQ_FIGURE = 3
"""[REQ_FIGURE, what] -> a figure of the session's memory or of the device, one of FIGURE_QUERIES."""
REQ_RUN = 4
"""[REQ_RUN, plan_id, first_output_handle, values] -> the output template (OP_RUN, answered)."""

SLOT_TENSOR = "T"
"""A plan slot for a tensor the job holds: its value is the handle."""
SLOT_NUMBER = "F"
"""A plan slot for a Python float (or int) the operation takes: its value is the number."""
SLOT_HOST_TENSOR = "H"
"""A plan slot for a host tensor: its value is [dtype, shape, stride, buffer]."""
PLAN_LIMIT = 1 << 16
"""Plan ids are below this; a client plans an id again rather than using more."""
PLAN_LEAVES = 1 << 21
"""Most values (list items, dict entries) all of a session's plans may hold together; a client
plans ids again from 0 once its plans hold half of this."""
REQ_COLLECTIVE = 5
"""[REQ_COLLECTIVE, group, seq, operator, spec] -> null once the collective has completed
(as OP_COLLECTIVE; for a barrier and whatever the program waits for)."""

# -- collectives ----------------------------------------------------------------------------------
COLLECTIVE_SPEC = {
    "tensors": "handles reduced or broadcast in place (allreduce, broadcast, reduce)",
    "inputs": "handles, or lists of group-size handles (scatter, reduce_scatter)",
    "outputs": "handles, or lists of group-size handles (allgather, gather)",
    "op": "the reduction: one of REDUCE_OPS",
    "factor": "the factor of a premul_sum reduction",
    "root": "the group rank of the source (broadcast, scatter) or destination (reduce, gather)",
    "input_splits": "rows of the input for each group rank (alltoall_base; empty: equal)",
    "output_splits": "rows of the output from each group rank (alltoall_base; empty: equal)",
}
"""The keys a collective's `spec` object may hold, and what each means."""
REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum")
"""Reductions, applied in global rank order (the same bits however the ranks are placed)."""

MEMORY_ALLOCATED = "allocated"  # -> bytes the session holds
MEMORY_PEAK = "peak"  # -> the most bytes it held since the last reset
MEMORY_RESET_PEAK = "reset_peak"  # -> null; the peak becomes the current figure
MEMORY_INFO = "info"  # -> [free bytes on the device, capacity]
MEMORY_STATS = "stats"  # -> a dict like torch.cuda.memory_stats()
UTILIZATION = "utilization"  # -> percent of the last second the device ran work, 0 to 100
FIGURE_QUERIES = (MEMORY_ALLOCATED, MEMORY_PEAK, MEMORY_RESET_PEAK, MEMORY_INFO, MEMORY_STATS, UTILIZATION)

# -- output templates: what an operation returned, in the REPLY to REQ_CALL -----------------------
TEMPLATE_TENSOR = "T"
"""[TEMPLATE_TENSOR, shape, stride, storage_offset, dtype, bytes of new storage]: a new tensor,
which takes the next handle (the client keeps [T, (shape, stride, offset, dtype), bytes])."""
TEMPLATE_ALIAS = "A"
"""[TEMPLATE_ALIAS, i]: the operation returned its i-th tensor input itself."""
TEMPLATE_SPARSE = "S"
"""[TEMPLATE_SPARSE, layout, shape, dtype, bytes of new storage]: a new sparse tensor (COO,
CSR, CSC, BSR or BSC), which takes the next handle."""
TEMPLATE_RESHAPED = "R"
"""[TEMPLATE_RESHAPED, i, shape, stride, storage_offset]: the operation changed its i-th tensor
input's shape, stride or offset in place (squeeze_, transpose_, resize_, set_, ...) and returned it."""
TEMPLATE_LIST = "L"
"""[TEMPLATE_LIST, [template, ...]]."""
TEMPLATE_TUPLE = "U"
"""[TEMPLATE_TUPLE, [template, ...]]."""
TEMPLATE_NONE = "N"
"""[TEMPLATE_NONE]."""
TEMPLATE_VALUE = "V"
"""[TEMPLATE_VALUE, value]: a plain value (number, bool, string; anything else as its repr)."""

# -- operators ----------------------------------------------------------------------------------
SERVED_NAMESPACES = ("aten", "prims", "singularity_proxy")
"""Namespaces whose operators a server may run for a job (see the server's operators.py); the last
is the proxy's own (encoder_operator.py)."""

# -- control channel ------------------------------------------------------------------------------
CONTROL_REQUESTS = (
    "quiesce", "settle", "save", "release", "load", "resume", "status", "stop",
    "prepare", "capture", "finish", "abort", "pause_times",
)  # fmt: skip

DEVICE_INFO_KEYS = ("name", "total_memory", "major", "minor", "multi_processor_count", "kind", "index")
"""What WELCOME tells a job process about its device."""

SERVER_FACTORIES = (
    "zeros", "ones", "empty", "full", "eye", "arange", "linspace", "logspace", "empty_strided",
)  # fmt: skip
"""torch functions a job may ask the server to run with OP_FACTORY (the tensor is made there)."""

# -- tags -----------------------------------------------------------------------------------------
TAG_HANDLE = "handle"
TAG_HOST_TENSOR = "tensor"
TAG_DEVICE = "device"
TAG_TUPLE = "tuple"
TAG_BYTES = "bytes"
TAG_COMPLEX = "complex"
TAG_DTYPE = "dtype"
TAG_LAYOUT = "layout"
TAG_MEMORY_FORMAT = "memory_format"
TAG_DICT = "dict"
TAG_SLOT = "slot"

DEVICE_MARKER = {TAG_DEVICE: "proxied"}
"""Stands for "the server's own device" wherever a torch.device appears in arguments."""


class TorchNames:
    """Wire names of torch's dtypes, layouts and memory formats, both ways (built on first use)."""

    def __init__(self) -> None:
        import torch

        def canonical(kind: type) -> dict[str, Any]:
            found = (v for v in vars(torch).values() if isinstance(v, kind))
            return {str(v).removeprefix("torch."): v for v in found}

        self.dtypes: dict[str, torch.dtype] = canonical(torch.dtype)
        self.layouts: dict[str, torch.layout] = canonical(torch.layout)
        self.memory_formats: dict[str, torch.memory_format] = canonical(torch.memory_format)
        self.dtype_names = {v: k for k, v in self.dtypes.items()}
        self.dtype_tags = {v: {TAG_DTYPE: k} for k, v in self.dtypes.items()}
        self.layout_tags = {v: {TAG_LAYOUT: k} for k, v in self.layouts.items()}
        self.memory_format_tags = {v: {TAG_MEMORY_FORMAT: k} for k, v in self.memory_formats.items()}
        self.encoders: dict[type, Any] = {
            torch.dtype: self.dtype_tags.__getitem__,
            torch.layout: self.layout_tags.__getitem__,
            torch.memory_format: self.memory_format_tags.__getitem__,
        }

    def dtype(self, name: Any) -> torch.dtype:
        """The dtype called `name`; ProtocolError for anything else."""
        found = self.dtypes.get(name) if type(name) is str else None
        if found is None:
            raise ProtocolError(f"unknown dtype {name!r}")
        return found


_torch_names: TorchNames | None = None


def torch_names() -> TorchNames:
    """The wire names of torch values (torch is imported on first call)."""
    global _torch_names
    if _torch_names is None:
        _torch_names = TorchNames()
    return _torch_names


# -- values --------------------------------------------------------------------------------------
def encode_value(value: Any, buffers: list[Any]) -> Any:
    """A JSON-ready form of `value`; bytes-like parts are appended to `buffers`.

    Takes None, bool, int, float, str, bytes-likes, complex, lists, tuples (tuple subclasses
    such as torch.Size as tuples), dicts with string keys, torch dtypes, layouts and memory
    formats. Anything else is a TypeError: nothing executable ever reaches the wire.
    """
    kind = type(value)
    if kind is int or kind is float or kind is str or kind is bool or value is None:
        return value
    if kind is list:
        return [encode_value(item, buffers) for item in value]
    if isinstance(value, tuple):
        return {TAG_TUPLE: [encode_value(item, buffers) for item in value]}
    if kind is dict:
        if not all(type(key) is str for key in value):
            raise TypeError("proxy: only dicts with string keys can be sent")
        return {TAG_DICT: {key: encode_value(item, buffers) for key, item in value.items()}}
    if kind is bytes or kind is bytearray or kind is memoryview:
        buffers.append(value)
        return {TAG_BYTES: len(buffers) - 1}
    if kind is complex:
        return {TAG_COMPLEX: [value.real, value.imag]}
    if "torch" in kind.__module__:
        encoder = torch_names().encoders.get(kind)
        if encoder is not None:
            return encoder(value)
    raise TypeError(f"proxy: a {kind.__module__}.{kind.__qualname__} cannot be sent")


def decode_value(tree: Any, buffers: Sequence[Any]) -> Any:
    """The value `encode_value` encoded as `tree`; ProtocolError for anything malformed."""
    kind = type(tree)
    if kind is list:
        return [decode_value(item, buffers) for item in tree]
    if kind is dict:
        return decode_tag(tree, buffers)
    return tree


def decode_tag(tag: dict[str, Any], buffers: Sequence[Any]) -> Any:
    """The value a one-key tag object stands for (handles and host tensors excepted)."""
    if len(tag) != 1:
        raise ProtocolError(f"a tag has one key, not {len(tag)}")
    ((name, payload),) = tag.items()
    if name == TAG_TUPLE and type(payload) is list:
        return tuple(decode_value(item, buffers) for item in payload)
    if name == TAG_DICT and type(payload) is dict:
        return {key: decode_value(item, buffers) for key, item in payload.items()}
    if name == TAG_BYTES:
        return buffer_at(buffers, payload)
    if name == TAG_COMPLEX and type(payload) is list and len(payload) == 2:
        return complex(number(payload[0]), number(payload[1]))
    if name == TAG_DTYPE:
        return torch_names().dtype(payload)
    if name == TAG_LAYOUT and payload in torch_names().layouts:
        return torch_names().layouts[payload]
    if name == TAG_MEMORY_FORMAT and payload in torch_names().memory_formats:
        return torch_names().memory_formats[payload]
    raise ProtocolError(f"unknown or malformed tag {name!r}")


def buffer_at(buffers: Sequence[Any], index: Any) -> Any:
    """The frame's buffer number `index`; ProtocolError if there is none."""
    if type(index) is not int or not 0 <= index < len(buffers):
        raise ProtocolError(f"no buffer {index!r} in this frame")
    return buffers[index]


def number(value: Any) -> float:
    """A JSON number as a float; ProtocolError for anything else."""
    if type(value) is int or type(value) is float:
        return float(value)
    raise ProtocolError(f"not a number: {value!r}")


def integer(value: Any, low: int = 0, high: int = 1 << 62) -> int:
    """A JSON integer within [low, high]; ProtocolError for anything else."""
    if type(value) is not int or not low <= value <= high:
        raise ProtocolError(f"not an integer in [{low}, {high}]: {value!r}")
    return value


def integers(values: Any, low: int = 0, high: int = 1 << 62, most: int = 64) -> list[int]:
    """A JSON list of at most `most` integers within [low, high]; ProtocolError otherwise."""
    if type(values) is not list or len(values) > most:
        raise ProtocolError(f"not a list of at most {most} integers: {values!r}"[:200])
    return [integer(v, low, high) for v in values]


# -- frames --------------------------------------------------------------------------------------
_BODY_ENCODER = json.JSONEncoder(separators=(",", ":"), check_circular=False)
_BODY_DECODER = json.JSONDecoder()
_JOIN_BELOW = 1 << 16
"""Frames whose buffers are smaller than this are written with one system call."""


def encode_body(body: Any) -> bytes:
    """The JSON bytes of an already JSON-ready body."""
    return _BODY_ENCODER.encode(body).encode()


def send_frame(sock: socket.socket, kind: int, body: Any, buffers: Sequence[Any] = ()) -> None:
    """Send one frame whose body is already JSON-ready (see `encode_value`)."""
    data = encode_body(body)
    header = FRAME_HEADER.pack(kind, len(buffers), len(data))
    if not buffers:
        sock.sendall(header + data)
        return
    sizes = [memoryview(buffer).nbytes for buffer in buffers]
    lengths = b"".join(BUFFER_LENGTH.pack(size) for size in sizes)
    if sum(sizes) < _JOIN_BELOW:
        sock.sendall(b"".join([header, lengths, data, *buffers]))
        return
    sock.sendall(header + lengths + data)
    for buffer in buffers:
        sock.sendall(buffer)


def send_message(sock: socket.socket, kind: int, value: Any) -> None:
    """Send one frame whose body is `value` (encoded with `encode_value`)."""
    buffers: list[Any] = []
    send_frame(sock, kind, encode_value(value, buffers), buffers)


def recv_exact(sock: socket.socket, size: int) -> bytearray:
    """Exactly `size` bytes; ConnectionError when the peer closes first."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        count = sock.recv_into(view[got:], size - got)
        if count == 0:
            raise ConnectionError("proxy connection closed")
        got += count
    return buf


@dataclass(frozen=True)
class Frame:
    """One frame as read: its kind, its JSON body (undecoded) and its buffers."""

    kind: int
    body: bytes | bytearray
    buffers: list[memoryview]

    def decode(self) -> Any:
        """The JSON body (tags left as they are); ProtocolError if it is not JSON."""
        try:
            return _BODY_DECODER.decode(self.body.decode())
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise ProtocolError(f"undecodable message body: {e}") from None

    def value(self) -> Any:
        """The body decoded with `decode_value`."""
        return decode_value(self.decode(), self.buffers)


def recv_frame(sock: socket.socket, limits: FrameLimits | None = None) -> Frame:
    """Read one frame; ProtocolError (before reading further) if it exceeds `limits`."""
    kind, count, body_size = FRAME_HEADER.unpack(recv_exact(sock, FRAME_HEADER.size))
    if limits is not None and (body_size > limits.body_bytes or count > limits.buffers):
        raise ProtocolError(
            f"frame too large: {body_size} bytes of body and {count} buffers "
            f"(at most {limits.body_bytes} and {limits.buffers})"
        )
    table = recv_exact(sock, count * BUFFER_LENGTH.size + body_size)
    lengths = [BUFFER_LENGTH.unpack_from(table, i * BUFFER_LENGTH.size)[0] for i in range(count)]
    total = sum(lengths)
    if limits is not None and total > limits.buffer_bytes:
        raise ProtocolError(f"frame too large: {total} bytes of buffers (at most {limits.buffer_bytes})")
    body = memoryview(table)[count * BUFFER_LENGTH.size :].tobytes()
    buffers: list[memoryview] = []
    if count:
        data = memoryview(recv_exact(sock, total))
        offset = 0
        for length in lengths:
            buffers.append(data[offset : offset + length])
            offset += length
    return Frame(kind, body, buffers)


# -- tensors as bytes ----------------------------------------------------------------------------
def storage_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a host tensor's whole storage, without copying; the view keeps the tensor alive."""
    storage = tensor.untyped_storage()
    size = storage.nbytes()
    if size == 0:
        return memoryview(b"")
    array = (ctypes.c_char * size).from_address(storage.data_ptr())
    array.owner = tensor  # type: ignore[attr-defined]
    return memoryview(array).cast("B")


def tensor_to_raw(tensor: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """A dense host copy of `tensor` (same strides where it is dense) and a view of its bytes."""
    import torch

    copy = torch.empty_like(tensor, device="cpu")
    copy.copy_(tensor)
    return copy, storage_view(copy)


def storage_extent(shape: Sequence[int], stride: Sequence[int], offset: int = 0) -> int:
    """Elements a storage needs for a view with this shape, stride and offset."""
    if any(size == 0 for size in shape):
        return 0
    return offset + 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))


def check_layout(
    dtype: Any, shape: Any, stride: Any, nbytes: int
) -> tuple[torch.dtype, list[int], list[int]]:
    """A dtype, shape and stride from the wire that fit in `nbytes`; ProtocolError otherwise."""
    found = torch_names().dtype(dtype)
    sizes = integers(shape)
    steps = integers(stride)
    if len(sizes) != len(steps):
        raise ProtocolError(f"shape {sizes} and stride {steps} differ in length")
    if storage_extent(sizes, steps) * found.itemsize > nbytes:
        raise ProtocolError(f"shape {sizes} with stride {steps} reaches past {nbytes} bytes of storage")
    return found, sizes, steps


def tensor_from_raw(dtype: Any, shape: Any, stride: Any, raw: Any) -> torch.Tensor:
    """A host tensor viewing `raw` (a writable buffer: a storage's bytes) with this layout.

    The layout is checked against the buffer's size first, so a peer cannot make a tensor
    that reaches outside the bytes it sent.
    """
    import torch

    view = memoryview(raw).cast("B")
    found, sizes, steps = check_layout(dtype, shape, stride, len(view))
    flat = torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)
    return torch.empty(0, dtype=found).set_(flat.untyped_storage(), 0, sizes, steps)
