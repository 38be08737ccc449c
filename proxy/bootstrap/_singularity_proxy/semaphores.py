"""Named multiprocessing semaphores mapped under their name, so that CRIU can dump their processes.

A semaphore made for the `spawn` or `forkserver` start method keeps its name in /dev/shm for the
processes that open it later, but glibc's `sem_open` made it under a temporary name, now
deleted, and that deleted name is what the creating process maps. CRIU dumps a mapping of a
deleted file that is still linked elsewhere only with `--link-remap`, which leaves files behind in
the machine's /dev/shm. Reopened by its name right after it is made, the creator maps the file
as every other process of the job does, and CRIU dumps it as a plain shared file.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any


def map_by_name(synchronize: ModuleType) -> None:
    """Make every named `multiprocessing.synchronize.SemLock` reopen itself by name once made."""
    semlock_class: Any = synchronize.SemLock
    if getattr(semlock_class.__init__, "_maps_by_name", False):
        return
    made = semlock_class.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        if self._semlock.name is not None:
            _reopen_by_name(self)

    __init__._maps_by_name = True  # type: ignore[attr-defined]
    semlock_class.__init__ = __init__


def _reopen_by_name(lock: Any) -> None:
    """Close the creator's handle (glibc shares one mapping per file, so it must go first) and
    open the semaphore again by its name; its count lives in the file and is kept."""
    import _multiprocessing  # type: ignore[import-not-found,unused-ignore]

    made = lock._semlock
    state = (made.handle, made.kind, made.maxvalue, made.name)
    del made
    for bound in ("acquire", "release"):
        lock.__dict__.pop(bound, None)
    lock._semlock = None
    lock._semlock = _multiprocessing.SemLock._rebuild(*state)
    lock._make_methods()
