"""The runtime record: everything the daemon holds in memory for one job whose processes it owns.

One record per job (like supervisor's `Subprocess`), created when the job is given devices or
re-adopted after a restart, and dropped when it gives them back. The state machine decides the
record's `activity`; every other field is a handle the daemon needs to carry that out.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass, field

from singularityd.checkpoint.interface import CheckpointTaken
from singularityd.core.decisions import Activity
from singularityd.jobs.processes import Watch


@dataclass(eq=False)
class JobRuntime:
    """The in-memory side of one job holding devices; each field described once.

    activity: what is under way (launching, a checkpoint, an exit held back, a preemption back-off)
        as the state machine last decided it.
    watch: the job's supervisor, watched until it ends; None while launching.
    kill_timer: SIGKILL for the supervisor once the grace period after SIGTERM has passed.
    periodic: the next periodic checkpoint.
    checkpoint_outcome: the result of the checkpoint under way, for a request that waits on it.
    launched: set once launching is over (or the record is dropped); requests that need running
        processes wait on it.
    """

    job_id: int
    activity: Activity = field(default_factory=Activity)
    watch: Watch | None = None
    kill_timer: asyncio.TimerHandle | None = None
    periodic: asyncio.TimerHandle | None = None
    checkpoint_outcome: asyncio.Future[CheckpointTaken] | None = None
    launched: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.update(self.activity)

    def update(self, activity: Activity) -> None:
        """Take the activity the state machine decided; wake waiters once launching is over."""
        self.activity = activity
        if activity.launching:
            self.launched.clear()
        else:
            self.launched.set()

    def terminate(self, grace_seconds: float) -> None:
        """SIGTERM the supervisor now, SIGKILL it if it is still there after the grace period."""
        watch = self.watch
        if watch is None:
            return
        watch.signal(signal.SIGTERM)
        if self.kill_timer is None:
            self.kill_timer = asyncio.get_running_loop().call_later(
                grace_seconds, lambda: watch.signal(signal.SIGKILL)
            )

    def rearm_periodic(self, timer: asyncio.TimerHandle) -> None:
        """Replace the pending periodic checkpoint with this one."""
        if self.periodic is not None:
            self.periodic.cancel()
        self.periodic = timer

    def close(self) -> None:
        """Stop watching, cancel the timers, wake whoever waits for the launch."""
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        for timer in (self.kill_timer, self.periodic):
            if timer is not None:
                timer.cancel()
        self.kill_timer = self.periodic = None
        self.launched.set()
