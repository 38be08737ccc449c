"""A hand-made job connection that speaks the proxy protocol directly: what a hostile job can send."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import torch

from singularity.proxy.bootstrap._singularity_proxy import protocol


class RawSession:
    """One connection to a proxy server, with nothing of the in-job client in between."""

    def __init__(self, socket_path: Path, job_id: str, rank: int = 0, timeout: float = 60.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(socket_path))
        self.job_id = job_id
        self.rank = rank

    def hello(self) -> protocol.Frame:
        """Open the session; the server's answer (WELCOME or ERROR)."""
        protocol.send_message(self.sock, protocol.HELLO, [self.job_id, self.rank, 0, False])
        return protocol.recv_frame(self.sock)

    def send(self, kind: int, body: Any, buffers: list[Any] | None = None) -> None:
        """Send one frame with a JSON-ready body."""
        protocol.send_frame(self.sock, kind, body, buffers or [])

    def request(self, ops: list[Any], request: list[Any], buffers: list[Any] | None = None) -> protocol.Frame:
        """Send operations and a request; the answer."""
        self.send(protocol.REQUEST, [ops, request], buffers)
        return protocol.recv_frame(self.sock)

    def upload(self, handle: int, values: torch.Tensor) -> None:
        """Queue (unanswered) a new tensor with these values under `handle`."""
        dtype = protocol.torch_names().dtype_names[values.dtype]
        op = [protocol.OP_UPLOAD, handle, dtype, list(values.shape), list(values.stride()), 0]
        self.send(protocol.BATCH, [[op]], [protocol.storage_view(values.contiguous())])

    def fetch(self, handle: int) -> protocol.Frame:
        """Ask for a tensor's values."""
        return self.request([], [protocol.REQ_FETCH, handle])

    def close(self) -> None:
        """Close the connection."""
        self.sock.close()


def values(answer: protocol.Frame) -> torch.Tensor:
    """The tensor a REPLY to REQ_FETCH carries."""
    assert answer.kind == protocol.REPLY, answer.value()
    dtype, shape, stride, raw = answer.value()
    return protocol.tensor_from_raw(dtype, shape, stride, raw)


def error(answer: protocol.Frame) -> str:
    """'Type: message' of an ERROR (or GOODBYE) answer."""
    assert answer.kind in (protocol.ERROR, protocol.GOODBYE), (answer.kind, answer.value())
    _module, qualname, message = answer.value()
    return f"{qualname}: {message}"
