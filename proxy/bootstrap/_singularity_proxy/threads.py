# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""The device mode in threads other than the main one: torch keeps function modes per thread, so
each thread that may use the devices must enter the mode (mode.py) itself."""

from __future__ import annotations

import threading
from typing import Any

from .channel import ReaderThread
from .mode import DeviceMode
from .on_import import patch_modules
from .tensor import under_device_mode


def enter_in_new_threads(mode: DeviceMode) -> None:
    """Let every thread the program starts from now on work under `mode` too, as its main thread
    does: torch keeps function modes per thread, and a DataLoader's pin-memory thread, a thread
    pool's workers or the program's own threads would otherwise see no device at all."""
    start = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def bootstrap_inner(thread: threading.Thread) -> None:
        if not isinstance(thread, ReaderThread):
            mode.__enter__()
        start(thread)

    threading.Thread._bootstrap_inner = bootstrap_inner  # type: ignore[attr-defined]


def hide_reader_threads() -> None:
    """Leave the channels' reader threads out of `threading.enumerate()` and `active_count()`, as
    a GPU's driver threads are not Python threads: a program listing its threads (to find strays,
    or to wait for its own) sees only its own."""
    everything = threading.enumerate

    def enumerate_own() -> list[threading.Thread]:
        return [thread for thread in everything() if not isinstance(thread, ReaderThread)]

    def active_count() -> int:
        return len(enumerate_own())

    threading.enumerate = enumerate_own
    threading.active_count = active_count


def enter_in_rpc_functions() -> None:
    """Run the functions torch.distributed.rpc calls for other processes under the device mode too:
    RPC runs them on threads of its own, started in C++, where enter_in_new_threads cannot reach,
    and `.to("cuda")` in a remote function failed as on a host without CUDA."""

    def patch(internal: Any) -> None:
        run = internal._run_function

        def run_function(python_udf: Any) -> Any:
            return under_device_mode(run, python_udf)

        internal._run_function = run_function

    patch_modules({"torch.distributed.rpc.internal": patch})
