"""torch's TCPStore and RPC without libuv where the job's environment says USE_LIBUV=0 (the daemon's
default).

A libuv TCPStore holds an io_uring, which CRIU cannot dump, so a job with one cannot be checkpointed.
torch reads USE_LIBUV only where init_process_group builds its store; torchrun's rendezvous
(c10d, static and the dynamic handler's shared store) builds TCPStore with libuv whatever the
environment says. With this in place every TCPStore of the process defaults to the plain backend;
a caller that asks for libuv by name still gets it. torch.distributed.rpc's TensorPipe agent holds
io_urings too, by default, in its libuv transport and channel: a job's RPC defaults to TensorPipe's
shared-memory transport and basic channel instead (its processes are all on this machine); options
that name transports or channels keep them.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Any

USE_LIBUV_POSITION = 8
"""use_libuv's place among TCPStore's positional arguments (host_name, port, world_size, is_master,
timeout, wait_for_workers, multi_tenant, master_listen_fd, use_libuv)."""


def wanted() -> bool:
    """Whether the job asked torch not to use libuv."""
    return os.environ.get("USE_LIBUV") == "0"


def default_without_libuv() -> None:
    """Make use_libuv=False the default of torch.distributed.TCPStore (once; no-op without it)."""
    import torch.distributed as dist

    if not dist.is_available() or not hasattr(dist, "TCPStore"):
        return
    store = dist.TCPStore
    original = store.__init__
    if getattr(original, "_sing_without_libuv", False):
        return

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) <= USE_LIBUV_POSITION and "use_libuv" not in kwargs:
            kwargs["use_libuv"] = False
        original(self, *args, **kwargs)

    init._sing_without_libuv = True  # type: ignore[attr-defined]
    store.__init__ = init


RPC_TRANSPORTS = ["shm"]
"""TensorPipe's transports for a job's RPC: shared memory, since a job's processes share a machine."""
RPC_CHANNELS = ["basic"]
"""TensorPipe's channels for a job's RPC: tensors travel through the transport (the libuv
multiplexing channel holds io_urings; the cross-memory one needs ptrace rights between processes)."""


def rpc_without_libuv(options: ModuleType) -> None:
    """Make RPC_TRANSPORTS and RPC_CHANNELS the defaults of torch.distributed.rpc's
    TensorPipeRpcBackendOptions (its module, `torch.distributed.rpc.options`, just imported)."""
    backend_options = options.TensorPipeRpcBackendOptions
    original = backend_options.__init__
    if getattr(original, "_sing_without_libuv", False):
        return

    @functools.wraps(original)
    def init(self: Any, *args: Any, _transports: Any = None, _channels: Any = None, **kwargs: Any) -> None:
        transports = list(RPC_TRANSPORTS) if _transports is None else _transports
        channels = list(RPC_CHANNELS) if _channels is None else _channels
        original(self, *args, _transports=transports, _channels=channels, **kwargs)

    init._sing_without_libuv = True  # type: ignore[attr-defined]
    backend_options.__init__ = init
