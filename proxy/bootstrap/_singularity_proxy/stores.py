"""torch's TCPStore without libuv where the job's environment says USE_LIBUV=0 (the daemon's default).

A libuv TCPStore holds an io_uring, which CRIU cannot dump, so a job with one cannot be checkpointed.
torch reads USE_LIBUV only where init_process_group builds its store; torchrun's rendezvous
(c10d, static and the dynamic handler's shared store) builds TCPStore with libuv whatever the
environment says. With this in place every TCPStore of the process defaults to the plain backend;
a caller that asks for libuv by name still gets it.
"""

from __future__ import annotations

import functools
import os
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
