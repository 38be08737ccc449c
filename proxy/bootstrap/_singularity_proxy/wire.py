"""Framing and message codes shared by the in-job client and the proxy server (stdlib only)."""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

LENGTH = struct.Struct("<Q")
PROTOCOL = pickle.HIGHEST_PROTOCOL

# Client -> server message kinds (first element of every message tuple).
HELLO = "hello"  # (HELLO, job_id, rank, device_index, resume: bool)
BATCH = "b"  # (BATCH, ops: list, request: tuple | None)
PARKED = "p"  # (PARKED, waiting): stopped at an operation boundary, maybe waiting on a value

# Server -> client message kinds.
WELCOME = "w"  # (WELCOME, info: dict)
REPLY = "r"  # (REPLY, value)
ERROR = "e"  # (ERROR, module, qualname, message)
PARK = "P"  # (PARK,): stop sending and acknowledge with PARKED
RESUME = "R"  # (RESUME,): go on

# Operations inside a batch (first element of each op tuple).
OP_CALL = 0  # (OP_CALL, op_id, out_ids, args, kwargs)
OP_DEF = 1  # (OP_DEF, op_id, "aten::name.overload")
OP_FREE = 2  # (OP_FREE, [handle, ...])
OP_UPLOAD = 3  # (OP_UPLOAD, handle, dtype, shape, stride, raw bytes)
OP_FACTORY = 4  # (OP_FACTORY, handle, torch function name, args, kwargs)
OP_FILL = 5  # (OP_FILL, handle, dtype, shape, stride, raw bytes): copy values into a tensor

# Requests that need a reply (the last element of a BATCH message).
REQ_CALL = 0  # (REQ_CALL, op_id, first_out_id, args, kwargs) -> output template
REQ_FETCH = 1  # (REQ_FETCH, handle) -> (dtype, shape, stride, raw bytes)
REQ_SYNC = 2  # (REQ_SYNC,) -> None once everything before it ran
REQ_MEMORY = 3  # (REQ_MEMORY, what) -> int or dict
REQ_RESET_PEAK = 4  # (REQ_RESET_PEAK,) -> None


def send_msg(sock: socket.socket, msg: Any) -> None:
    """Send one length-prefixed pickled message."""
    data = pickle.dumps(msg, PROTOCOL)
    sock.sendall(LENGTH.pack(len(data)) + data)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly n bytes; ConnectionError when the peer closes first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("proxy connection closed")
        got += k
    return bytes(buf)


def recv_msg(sock: socket.socket) -> Any:
    """Receive one length-prefixed pickled message; ConnectionError at end of stream."""
    (n,) = LENGTH.unpack(recv_exact(sock, LENGTH.size))
    return pickle.loads(recv_exact(sock, n))
