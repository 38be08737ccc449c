"""Stimuli: the things that happen to a job, which the job state machine turns into decisions."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Started:
    """The scheduler gave the job devices; its processes are launched (or restored) next."""

    devices: tuple[int, ...]


@dataclass(frozen=True)
class ProcessesRunning:
    """The job's supervisor runs: just launched, or found running after a daemon restart."""

    pid: int
    start_ticks: int


@dataclass(frozen=True)
class Restored:
    """The job's processes were restored from checkpoint `seq`; newer ones were `skipped`.

    `problem` is set when the processes run but the device proxies did not take them back: the
    job cannot go on and is stopped.
    """

    pid: int
    start_ticks: int
    seq: int
    skipped: tuple[tuple[int, str], ...] = ()
    problem: str = ""
    downtime: str = ""
    """How long the job was down, as the restore event says it (empty when not measured)."""


@dataclass(frozen=True)
class LaunchFailed:
    """The job's processes could not be started."""

    error: str


@dataclass(frozen=True)
class Exited:
    """The job's processes ended; exactly one of exit_code/signal is usually set."""

    exit_code: int | None
    signal: int | None
    error: str = ""
    cpu_seconds: float | None = None
    max_rss_bytes: int | None = None
    device_lost: str = ""
    """How the job lost a device while it ran (its proxy server ended), which a failure follows from."""


@dataclass(frozen=True)
class CancelRequested:
    """A user asked to cancel the job."""

    by: str


@dataclass(frozen=True)
class ProcessesLost:
    """The job's processes vanished without an exit status (e.g. while the daemon was down)."""

    detail: str


@dataclass(frozen=True)
class Requeued:
    """The job's launch was interrupted before its processes existed; it may run again."""

    detail: str


@dataclass(frozen=True)
class PreemptRequested:
    """Checkpoint the job and stop it: back to the queue, or held until resumed by hand."""

    by: str
    hold: bool = False


@dataclass(frozen=True)
class ResizeRequested:
    """Checkpoint the job and stop it, to be restored on `gpus` devices (its processes see no change)."""

    by: str
    gpus: int


@dataclass(frozen=True)
class PreemptionWanted:
    """The scheduler wants the job's devices for a queued job that outranks it (higher tier, or
    the same tier and a higher priority)."""

    for_job: int = 0
    """That job's id (0: not said)."""


@dataclass(frozen=True)
class ResumeRequested:
    """Release a held (SUSPENDED) job back into the queue."""

    by: str


@dataclass(frozen=True)
class CheckpointRequested:
    """Checkpoint the job and let it keep running."""

    by: str


@dataclass(frozen=True)
class PeriodicCheckpointDue:
    """The job's periodic checkpoint interval has passed."""


@dataclass(frozen=True)
class Checkpointed:
    """The checkpoint under way completed; `summary` says what it wrote, `image_bytes` how much,
    `pause_s` how long the job could not make progress for it."""

    summary: str
    image_bytes: int = 0
    pause_s: float = 0.0
    complete_s: float = 0.0
    """From the start of the pause until the checkpoint was complete."""


@dataclass(frozen=True)
class CheckpointFailed:
    """The checkpoint under way did not complete; previous images stay. The job keeps running, or,
    with `job_ended`, its processes ended meanwhile (not a failure: its exit says how it ends)."""

    error: str
    job_ended: bool = False


@dataclass(frozen=True)
class RestoreFailed:
    """No checkpoint of the job could be restored."""

    error: str
    checkpoint_good: bool = False
    """A checkpoint verified and only bringing its processes back failed (CRIU, the devices):
    something outside the job may be in the way (an address taken, a file moved) for a while."""


@dataclass(frozen=True)
class MoveStopRequested:
    """A hand-off to `peer` needs the job stopped with a complete final checkpoint (or queued
    jobs just set aside)."""

    peer: str


@dataclass(frozen=True)
class Arrived:
    """The job's processes, restored here frozen for a move, were let run on `devices`."""

    pid: int
    start_ticks: int
    devices: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class MoveAbandoned:
    """The job, set aside for a move, stays here: queued to resume from its checkpoint (or start),
    or, `held` (it was suspended when set aside), suspended until `sing resume`."""

    reason: str
    held: bool = False


@dataclass(frozen=True)
class MovedAway:
    """The job lives on another node now, or a copy that was arriving here was given up."""

    reason: str


Stimulus = (
    Started
    | ProcessesRunning
    | Restored
    | LaunchFailed
    | Exited
    | CancelRequested
    | ProcessesLost
    | Requeued
    | PreemptRequested
    | ResizeRequested
    | PreemptionWanted
    | ResumeRequested
    | CheckpointRequested
    | PeriodicCheckpointDue
    | Checkpointed
    | CheckpointFailed
    | RestoreFailed
    | MoveStopRequested
    | Arrived
    | MoveAbandoned
    | MovedAway
)
