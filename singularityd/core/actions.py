"""Actions: what the daemon carries out, in order, for a decision of the job state machine."""

from __future__ import annotations

from dataclasses import dataclass

from singularityd.core.stimuli import Exited, ProcessesLost


@dataclass(frozen=True)
class LaunchProcesses:
    """Start the job's processes from its command; report ProcessesRunning or LaunchFailed."""


@dataclass(frozen=True)
class RestoreProcesses:
    """Restore the job's processes from its newest good checkpoint; report Restored or RestoreFailed."""


@dataclass(frozen=True)
class WatchProcesses:
    """Record the job's supervisor (PID and start time) and watch it until it ends."""

    pid: int
    start_ticks: int


@dataclass(frozen=True)
class TerminateProcesses:
    """Ask the job's processes to stop (SIGTERM, then SIGKILL after the grace period)."""


@dataclass(frozen=True)
class ReleaseDevices:
    """Give the job's devices back to the pool and drop what the daemon holds for its processes."""


@dataclass(frozen=True)
class MarkCancelRequested:
    """Remember that the job's coming exit is a cancellation."""


@dataclass(frozen=True)
class Reschedule:
    """Run the scheduling policy again (devices freed or the queue changed)."""


@dataclass(frozen=True)
class RescheduleAfter:
    """Run the scheduling policy again once `seconds` have passed."""

    seconds: float


@dataclass(frozen=True)
class TakeCheckpoint:
    """Checkpoint the job's processes; report Checkpointed or CheckpointFailed.

    `stop`: the processes end with the dump (hold: keep the job off the queue afterwards;
    for_move: set it aside as MIGRATING for a hand-off to a peer). `reason` starts the event that
    records the checkpoint. `periodic` and `for_scheduler` say who asked, which decides what a
    failure or success leads to.
    """

    stop: bool
    hold: bool = False
    reason: str = "checkpoint"
    periodic: bool = False
    for_scheduler: bool = False
    for_move: bool = False
    gpus: int = 0
    """For a resize: the number of devices the job is restored on (0 otherwise)."""


@dataclass(frozen=True)
class ArmPeriodicCheckpoint:
    """Deliver PeriodicCheckpointDue after `after` seconds."""

    after: float


@dataclass(frozen=True)
class CountRestart:
    """Count one of the job's restarts after a failure (`sing submit --max-restarts`)."""


@dataclass(frozen=True)
class DiscardCheckpoints:
    """Remove the job's checkpoints: it has ended for good, so nothing can resume from them."""

    without_processes: bool = False
    """The job ended with no processes here to end (cancelled while preempted or suspended, or
    never restored): the /dev/shm files its checkpoints carried, which its processes would have
    removed as they ended, go too."""


@dataclass(frozen=True)
class Note:
    """Record an event in the job's log without changing its state."""

    reason: str


@dataclass(frozen=True)
class Replay:
    """Feed a stimulus held back earlier (an exit seen during a checkpoint) to the state machine."""

    stimulus: Exited | ProcessesLost


Action = (
    LaunchProcesses
    | RestoreProcesses
    | WatchProcesses
    | TerminateProcesses
    | ReleaseDevices
    | MarkCancelRequested
    | Reschedule
    | RescheduleAfter
    | TakeCheckpoint
    | ArmPeriodicCheckpoint
    | CountRestart
    | DiscardCheckpoints
    | Note
    | Replay
)
