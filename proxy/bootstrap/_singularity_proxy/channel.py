"""The connection of a job process to the proxy server of one device.

Operations are queued and sent in batches without waiting; only a request (a value the
program reads, an output template the client has not seen yet, a sync) waits for the
server's answer. A reader thread takes every message the server sends: answers go to the
one waiting request, PARK stops the process at an operation boundary until RESUME.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from typing import Any

import torch

from . import numerics, protocol

BATCH_OPS = 128
"""Queued operations are sent once this many are waiting (or at the next request)."""

READER_EXIT_SECONDS = 5.0
"""How long closing a channel waits for its reader thread to end."""


class ProxyConnectionError(RuntimeError):
    """The connection of this process to a proxy server failed or was refused."""


CLIENT_LOCK = threading.RLock()
"""Held by the thread working on the devices: the client's queues, handles and plans are one
thread's at a time (a program's threads may use the devices as they may use a GPU)."""


class ReaderThread(threading.Thread):
    """A channel's own thread reading answers: the only thread of a job that works without the
    device mode (threads.enter_in_new_threads)."""


class Channel:
    """The connection of this process to the proxy server of one device."""

    def __init__(self, path: str, index: int, job_id: str, rank: int, process: int) -> None:
        self.index = index
        self.device = torch.device("cuda", index)
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(path)
        fd = protocol.FD_BASE + index
        os.dup2(connection.fileno(), fd, inheritable=False)
        connection.close()
        self.sock = socket.socket(fileno=fd)
        self.send_lock = threading.Lock()
        """Held while a message is being written, and for the whole of a park."""
        self.request_lock = threading.Lock()
        """Held by the one thread waiting for an answer."""
        self.pending: list[list[Any]] = []
        """Operations queued and not yet sent (JSON-ready, see protocol.OP_*)."""
        self.pending_buffers: list[Any] = []
        """Buffers the queued operations refer to, by position."""
        self.pending_buffer_bytes = 0
        self.freed: list[int] = []
        """Handles of stand-ins that died since the last send (appended from __del__)."""
        self.next_handle = 1
        self.op_ids: dict[Any, int] = {}
        """The id each operator was defined under on the server."""
        self.calls: dict[Any, list[Any]] = {}
        """Per operation signature: [plan id, output template (None until known), new tensor
        count, new bytes] (see encoding.py)."""
        self.next_plan = 0
        self.default_dtype = torch.float32
        """The default floating dtype the server runs this process's operations with."""
        self.settings_version = 0
        """numerics.VERSION when the settings were last looked at."""
        self.settings: dict[str, Any] | None = None
        """The numeric settings last sent (None: none yet, the server runs with torch's own)."""
        self.plan_leaves = 0
        """Values (list items, dict entries) the plans since the last restart hold, as the server counts."""
        self._answer: protocol.Frame | None = None
        self._answered = threading.Event()
        self._failure: BaseException | None = None
        protocol.send_message(self.sock, protocol.HELLO, [job_id, rank, index, False, process])
        welcome = protocol.recv_frame(self.sock)
        if welcome.kind != protocol.WELCOME:
            raise ProxyConnectionError(str(welcome.value()[-1]))
        self.info: dict[str, Any] = welcome.value()
        self.sync_bytes = max(1 << 20, int(self.info["total_memory"]) // 64)
        """Transfers and allocations this large wait for the server (out of memory shows at the call)."""
        self.opener_pid = os.getpid()
        self.reader = ReaderThread(target=self._read, name=f"sing-proxy-{index}", daemon=True)
        self.reader.start()

    # -- reader thread ----------------------------------------------------------------------------
    def _deliver(self, frame: protocol.Frame) -> None:
        """Hand the answer to the waiting request, or end the connection on GOODBYE."""
        if frame.kind == protocol.GOODBYE:
            _module, qualname, message = frame.value()
            raise ProxyConnectionError(f"{qualname}: {message}")
        self._answer = frame
        self._answered.set()

    def _read(self) -> None:
        """Take every message the server sends until the connection ends."""
        try:
            while True:
                frame = protocol.recv_frame(self.sock)
                if frame.kind == protocol.PARK:
                    self._park()
                else:
                    self._deliver(frame)
        except BaseException as e:  # the server went away: wake any waiter with an error
            self._failure = e
            self._answered.set()

    def _park(self) -> None:
        """Stop at an operation boundary: no message is half sent while parked."""
        with self.send_lock:
            protocol.send_frame(self.sock, protocol.PARKED, [self.request_lock.locked()])
            while True:
                frame = protocol.recv_frame(self.sock)
                if frame.kind == protocol.RESUME:
                    return
                if frame.kind != protocol.PARK:
                    self._deliver(frame)

    # -- sending ----------------------------------------------------------------------------------
    def _gone(self) -> ProxyConnectionError:
        return ProxyConnectionError(f"proxy server for cuda:{self.index} is gone: {self._failure}")

    def push(self, op: list[Any]) -> None:
        """Queue one operation (after the frees since the last one, so the server lets their
        memory go in the program's order); send the queue when it is long enough."""
        pending = self.pending
        if self.freed:
            freed, self.freed = self.freed, []
            pending.append([protocol.OP_FREE, freed])
        pending.append(op)
        if len(pending) >= BATCH_OPS:
            self.flush()

    def attach(self, buffers: list[Any]) -> int:
        """Queue the buffers of the next operation pushed; the frame index of the first.

        The queue is sent first when they would take the frame past CHUNK_BYTES of buffers
        or MAX_BUFFERS, so that no frame exceeds what a server accepts.
        """
        size = sum(memoryview(buffer).nbytes for buffer in buffers)
        if size > protocol.CHUNK_BYTES or len(buffers) > protocol.MAX_BUFFERS:
            raise ValueError(f"proxy: {size} bytes in {len(buffers)} buffers are too many for one frame")
        if (
            self.pending_buffer_bytes + size > protocol.CHUNK_BYTES
            or len(self.pending_buffers) + len(buffers) > protocol.MAX_BUFFERS
        ):
            self.flush()
        first = len(self.pending_buffers)
        self.pending_buffers += buffers
        self.pending_buffer_bytes += size
        return first

    def _take(self) -> tuple[list[list[Any]], list[Any]]:
        """Everything queued (with the frees last) and its buffers, emptying the queue."""
        ops, buffers = self.pending, self.pending_buffers
        self.pending, self.pending_buffers, self.pending_buffer_bytes = [], [], 0
        if self.freed:
            freed = self.freed
            self.freed = []
            ops.append([protocol.OP_FREE, freed])
        return ops, buffers

    def flush(self) -> None:
        """Send every queued operation without waiting for it to run."""
        if self._failure is not None:
            raise self._gone()
        with self.send_lock:
            ops, buffers = self._take()
            if ops:
                protocol.send_frame(self.sock, protocol.BATCH, [ops], buffers)

    def close(self) -> None:
        """Send what is queued, end the connection and wait for the reader thread to end.

        At interpreter exit no thread of the client may still run: a daemon thread inside torch
        (freeing a tensor its garbage collection found, say) when Python finalizes cannot take the
        GIL back, and its unwinding ends the process in std::terminate (SIGABRT, exit 134) after
        the program has done all it does. A forked child shares the connection: only the process
        that opened it closes it.
        """
        if os.getpid() != self.opener_pid:
            return
        with contextlib.suppress(Exception):
            self.flush()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.reader.join(READER_EXIT_SECONDS)

    def request(self, request: list[Any]) -> Any:
        """Send the queue and one request, wait for its answer, raise what the server raised."""
        with self.request_lock:
            if self._failure is not None:
                raise self._gone()
            self._answered.clear()
            with self.send_lock:
                ops, buffers = self._take()
                protocol.send_frame(self.sock, protocol.REQUEST, [ops, request], buffers)
            self._answered.wait()
            answer = self._answer
            self._answer = None
            if answer is None:
                raise self._gone()
        if answer.kind == protocol.ERROR:
            raise rebuild_error(*answer.value())
        return answer.value()

    def op_id(self, func: Any) -> int:
        """The id of an operator on the server, defining it there on first use."""
        op_id = self.op_ids.get(func)
        if op_id is None:
            op_id = len(self.op_ids) + 1
            self.op_ids[func] = op_id
            self.pending.append([protocol.OP_DEFINE, op_id, func.namespace, func._opname, func._overloadname])
        return op_id

    def plan(self, key: Any, func: Any, args: list[Any], kwargs: dict[str, Any] | None) -> list[Any]:
        """Plan a call of a new signature (queued OP_PLAN); its entry in `calls`.

        Plan ids are taken in order up to PLAN_LIMIT, or until the plans hold half of what a
        server keeps (PLAN_LEAVES); then every plan is forgotten and ids are planned again from
        0 (the server replaces a plan planned again).
        """
        leaves = _leaves(args) + _leaves(kwargs)
        if self.next_plan >= protocol.PLAN_LIMIT or self.plan_leaves + leaves > protocol.PLAN_LEAVES // 2:
            self.calls.clear()
            self.next_plan = self.plan_leaves = 0
        self.plan_leaves += leaves
        plan_id = self.next_plan
        self.next_plan = plan_id + 1
        op_id = self.op_id(func)
        self.pending.append([protocol.OP_PLAN, plan_id, op_id, args, kwargs])
        entry = [plan_id, None, 0, 0]
        self.calls[key] = entry
        return entry

    def follow_settings(self, default_dtype: torch.dtype) -> None:
        """Before an operation is sent: have it and those after it run with the process's numeric
        settings (its default dtype, given as the current one, and oneDNN's precisions:
        numerics.py), sent again when they may have changed and did."""
        if default_dtype is self.default_dtype and self.settings_version == numerics.VERSION[0]:
            return
        settings = numerics.current()
        if settings != self.settings:
            self.push([protocol.OP_SETTINGS, settings])
            self.settings = settings
        self.default_dtype = default_dtype
        self.settings_version = numerics.VERSION[0]

    def new_handle(self, count: int = 1) -> int:
        """The first of `count` fresh tensor handles."""
        first = self.next_handle
        self.next_handle = first + count
        return first


def _leaves(tree: Any) -> int:
    """Values in a plan's wire form, counted as the server counts them (plans.Plan._decode)."""
    if type(tree) is list:
        return 1 + sum(_leaves(item) for item in tree)
    if type(tree) is dict and protocol.TAG_SLOT not in tree:
        return 1 + sum(_leaves(item) for item in tree.values())
    return 1


def rebuild_error(module: str, qualname: str, message: str) -> BaseException:
    """The exception the server raised, with the same type (when importable) and message."""
    found: Any = sys.modules.get(module)
    if found is None:
        try:
            found = __import__(module, fromlist=["_"])
        except Exception:
            found = None
    for part in qualname.split("."):
        found = getattr(found, part, None) if found is not None else None
    if isinstance(found, type) and issubclass(found, BaseException):
        try:
            return found(message)
        except Exception:
            pass
    return RuntimeError(message)
