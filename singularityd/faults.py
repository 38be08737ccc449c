"""Fault points: named steps where a daemon started with SING_FAULT_POINT=<name> kills itself.

Tests use them to crash a real daemon at one exact step (not at a moment picked by timing) and
then check what its restart makes of the state it left. Points a daemon passes in its event loop
can hold it instead (`held_at`): with SING_FAULT_HOLD=<file> too, the daemon writes <file>.reached
and waits there (the rest of the daemon running on) until the test creates <file>, so a test can
act (cut a link, say) while the daemon is exactly at that step. Unset, every point is a no-op.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "SING_FAULT_POINT"
HOLD_ENV = "SING_FAULT_HOLD"
HOLD_POLL_S = 0.05
CONNECTIONS_FOUND = "connections-found"
"""A checkpoint has found the job's device connections (to name them to CRIU) and not dumped yet."""
STOPPING_DUMP_RUNNING = "stopping-dump-running"
"""CRIU is dumping a job that the dump stops (a preemption or a move), and has not returned."""
STOPPING_DUMP_DONE = "stopping-dump-done"
"""CRIU has dumped and stopped the job; the checkpoint's manifest is not written yet."""
STOPPED_DUMP_RECORDED = "stopped-dump-recorded"
"""A dump that stops the job is complete and its manifest durable; the job's new state (stopped)
is not stored yet."""
RESTORE_CHECKED = "restore-checked"
"""A restore has checked the paths CRIU will make again by name and not yet run CRIU."""
STAGED_MOVE_RUNNING = "staged-move-running"
"""A checkpoint taken in place was dumped to memory, the job runs again, and its process images are
being moved to disk (one file moved); the manifest is not written yet."""
ARRIVAL_IMPORTED = "arrival-imported"
"""A target has stored an arriving job's record (MIGRATING, its devices reserved) and has not
placed its files or restored its processes."""
PRELOADED = "preloaded"
"""A target has read the pre-copied device state of an arriving job onto its devices and not yet
answered the pre-send (its sender has not stopped the job)."""
RESTORED_FROZEN = "restored-frozen"
"""A target has restored an arriving job frozen (its processes exist, stopped) and not yet
reported it: the hand-off still says it is restoring."""


def reached(point: str) -> None:
    """SIGKILL this process if it was told to die at `point` (SING_FAULT_POINT)."""
    if os.environ.get(ENV) == point:
        log.warning("fault point %s reached: killing this process", point)
        os.kill(os.getpid(), signal.SIGKILL)


async def held_at(point: str) -> None:
    """At `point`: with SING_FAULT_HOLD set, announce it and wait for the test's file; else `reached`."""
    if os.environ.get(ENV) != point:
        return
    hold = os.environ.get(HOLD_ENV)
    if not hold:
        reached(point)
        return
    log.warning("fault point %s reached: holding until %s exists", point, hold)
    Path(f"{hold}.reached").touch()
    while not Path(hold).exists():
        await asyncio.sleep(HOLD_POLL_S)
