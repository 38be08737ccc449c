"""Prints, once a tenth of a second until a release file exists, whether /proc/<os.getpid()> is this
process (as psutil.Process() and the like assume), then "done"."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def proc_is_mine() -> bool:
    """Whether the /proc entry named by this process's PID is this process."""
    named = f"/proc/{os.getpid()}"
    try:
        same_command = Path(named, "cmdline").read_bytes() == Path("/proc/self/cmdline").read_bytes()
        return same_command and os.path.realpath("/proc/self") == named
    except FileNotFoundError:
        return False


release = Path(sys.argv[1])
line = 0
while not release.exists():
    print(line, proc_is_mine(), flush=True)
    line += 1
    time.sleep(0.1)
print("done", flush=True)
