"""Fault points: named steps where a daemon started with SING_FAULT_POINT=<name> kills itself.

Tests use them to crash a real daemon at one exact step (not at a moment picked by timing) and
then check what its restart makes of the state it left. Unset, every point is a no-op.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)

ENV = "SING_FAULT_POINT"
STOPPING_DUMP_RUNNING = "stopping-dump-running"
"""CRIU is dumping a job that the dump stops (a preemption or a move), and has not returned."""
STOPPING_DUMP_DONE = "stopping-dump-done"
"""CRIU has dumped and stopped the job; the checkpoint's manifest is not written yet."""
STAGED_MOVE_RUNNING = "staged-move-running"
"""A checkpoint taken in place was dumped to memory, the job runs again, and its process images are
being moved to disk (one file moved); the manifest is not written yet."""


def reached(point: str) -> None:
    """SIGKILL this process if it was told to die at `point` (SING_FAULT_POINT)."""
    if os.environ.get(ENV) == point:
        log.warning("fault point %s reached: killing this process", point)
        os.kill(os.getpid(), signal.SIGKILL)
