"""The job state machine: pure decisions, no I/O.

The daemon feeds a job's current facts and one stimulus to `decide`, records the transition it
returns in the store and carries out the actions. Keeping this free of I/O lets every rule be
tested in microseconds and replayed by a simulator.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, field


class JobState(enum.StrEnum):
    """The states a job passes through; the terminal ones never change again."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"
    PREEMPTED = "PREEMPTED"
    MIGRATING = "MIGRATING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        """Whether the job has ended for good."""
        return self in TERMINAL_STATES

    @property
    def is_queued(self) -> bool:
        """Whether the scheduler may start (or resume) the job when devices free up."""
        return self in QUEUED_STATES

    @property
    def holds_devices(self) -> bool:
        """Whether the job's processes exist and own devices in this state."""
        return self in (JobState.RUNNING, JobState.MIGRATING)


TERMINAL_STATES = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED})
QUEUED_STATES = frozenset({JobState.PENDING, JobState.PREEMPTED})

ALLOWED_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.RUNNING, JobState.SUSPENDED, JobState.CANCELLED, JobState.FAILED}),
    JobState.RUNNING: frozenset(
        {
            JobState.COMPLETED,
            JobState.FAILED,
            JobState.CANCELLED,
            JobState.SUSPENDED,
            JobState.PREEMPTED,
            JobState.MIGRATING,
            JobState.PENDING,
        }
    ),
    JobState.SUSPENDED: frozenset(
        {JobState.PENDING, JobState.PREEMPTED, JobState.CANCELLED, JobState.FAILED}
    ),
    JobState.PREEMPTED: frozenset(
        {JobState.RUNNING, JobState.SUSPENDED, JobState.CANCELLED, JobState.FAILED}
    ),
    JobState.MIGRATING: frozenset(
        {JobState.RUNNING, JobState.PREEMPTED, JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.COMPLETED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class InvalidTransition(ValueError):
    """A stimulus asked for a change the job's state does not allow."""


@dataclass(frozen=True)
class Transition:
    """One recorded change of a job's state, always with the reason for it."""

    job_id: int
    from_state: JobState | None
    to_state: JobState
    reason: str
    at: float


def check_transition(job_id: int, current: JobState, target: JobState, reason: str, at: float) -> Transition:
    """Return the transition from `current` to `target`, or raise InvalidTransition."""
    if target not in ALLOWED_TRANSITIONS[current]:
        raise InvalidTransition(f"job {job_id} is {current}; it cannot become {target}")
    if not reason:
        raise ValueError("every transition needs a reason")
    return Transition(job_id, current, target, reason, at)


@dataclass(frozen=True)
class JobFacts:
    """What the state machine needs to know about a job to decide."""

    job_id: int
    state: JobState
    cancel_requested: bool = False
    has_checkpoint: bool = False
    checkpointing: bool = False
    checkpoints_available: bool = True


# Stimuli: things that happened to a job.


@dataclass(frozen=True)
class Started:
    """The scheduler gave the job devices; its processes are launched (or restored) next."""

    devices: tuple[int, ...]


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
class ResumeRequested:
    """Release a held (SUSPENDED) job back into the queue."""

    by: str


@dataclass(frozen=True)
class CheckpointRequested:
    """Checkpoint the job and let it keep running."""

    by: str


@dataclass(frozen=True)
class Checkpointed:
    """A checkpoint completed; `stopped` when the job's processes were stopped by it."""

    summary: str
    stopped: bool
    hold: bool = False


@dataclass(frozen=True)
class CheckpointFailed:
    """A checkpoint did not complete; the job keeps running and the previous images stay."""

    error: str


@dataclass(frozen=True)
class RestoreFailed:
    """No checkpoint of the job could be restored."""

    error: str


Stimulus = (
    Started
    | LaunchFailed
    | Exited
    | CancelRequested
    | ProcessesLost
    | Requeued
    | PreemptRequested
    | ResumeRequested
    | CheckpointRequested
    | Checkpointed
    | CheckpointFailed
    | RestoreFailed
)


# Actions: what the daemon must carry out.


@dataclass(frozen=True)
class TerminateProcesses:
    """Ask the job's processes to stop (SIGTERM, then SIGKILL after the grace period)."""


@dataclass(frozen=True)
class ReleaseDevices:
    """Give the job's devices back to the pool."""


@dataclass(frozen=True)
class MarkCancelRequested:
    """Remember that the job's coming exit is a cancellation."""


@dataclass(frozen=True)
class Reschedule:
    """Run the scheduling policy again (devices freed or the queue changed)."""


@dataclass(frozen=True)
class TakeCheckpoint:
    """Checkpoint the job's processes; stop them afterwards when `stop` (hold: keep off the queue)."""

    stop: bool
    hold: bool = False


@dataclass(frozen=True)
class Note:
    """Record an event in the job's log without changing its state."""

    reason: str


Action = TerminateProcesses | ReleaseDevices | MarkCancelRequested | Reschedule | TakeCheckpoint | Note


@dataclass(frozen=True)
class Decision:
    """The outcome of one stimulus: an optional transition and the actions to carry out."""

    transition: Transition | None = None
    actions: tuple[Action, ...] = field(default_factory=tuple)


def describe_exit(exit_code: int | None, sig: int | None) -> str:
    """A short human description of how processes ended."""
    if sig is not None:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by {name}"
    if exit_code is None:
        return "ended without an exit status"
    return f"exited with code {exit_code}"


def shell_exit_status(exit_code: int | None, sig: int | None) -> int | None:
    """The status a shell would report: the exit code, or 128 + the signal number."""
    if sig is not None:
        return 128 + sig
    return exit_code


def _require_running(job: JobFacts, verb: str) -> None:
    if job.state is not JobState.RUNNING:
        raise InvalidTransition(f"job {job.job_id} is {job.state}; only a RUNNING job can be {verb}")
    if not job.checkpoints_available:
        raise InvalidTransition(f"job {job.job_id} cannot be {verb}: checkpoints are unavailable here")
    if job.checkpointing:
        raise InvalidTransition(f"job {job.job_id} is already being checkpointed")
    if job.cancel_requested:
        raise InvalidTransition(f"job {job.job_id} is being cancelled")


def decide(job: JobFacts, stimulus: Stimulus, now: float) -> Decision:
    """Decide what a stimulus does to a job: the transition to record and the actions to take."""
    state = job.state
    match stimulus:
        case Started(devices=devices):
            listed = ",".join(str(d) for d in devices)
            where = f"device{'s' if len(devices) != 1 else ''} {listed}"
            reason = (
                f"resumed from its checkpoint on {where}" if job.has_checkpoint else f"started on {where}"
            )
            return Decision(check_transition(job.job_id, state, JobState.RUNNING, reason, now))
        case LaunchFailed(error=error):
            return Decision(
                check_transition(job.job_id, state, JobState.FAILED, f"launch failed: {error}", now),
                (ReleaseDevices(), Reschedule()),
            )
        case Exited(exit_code=code, signal=sig, error=error):
            how = error or describe_exit(code, sig)
            if job.cancel_requested:
                target, reason = JobState.CANCELLED, f"cancelled ({how})"
            elif code == 0 and sig is None and not error:
                target, reason = JobState.COMPLETED, how
            else:
                target, reason = JobState.FAILED, how
            return Decision(
                check_transition(job.job_id, state, target, reason, now),
                (ReleaseDevices(), Reschedule()),
            )
        case CancelRequested(by=by):
            if state.is_terminal:
                raise InvalidTransition(f"job {job.job_id} is already {state}")
            if state.holds_devices:
                if job.cancel_requested:
                    return Decision(actions=(TerminateProcesses(),))
                return Decision(actions=(MarkCancelRequested(), TerminateProcesses()))
            return Decision(
                check_transition(job.job_id, state, JobState.CANCELLED, f"cancelled by {by}", now),
                (ReleaseDevices(), Reschedule()),
            )
        case ProcessesLost(detail=detail):
            if job.has_checkpoint and not job.cancel_requested:
                reason = f"{detail}; queued to resume from its last checkpoint"
                return Decision(
                    check_transition(job.job_id, state, JobState.PREEMPTED, reason, now),
                    (ReleaseDevices(), Reschedule()),
                )
            target = JobState.CANCELLED if job.cancel_requested else JobState.FAILED
            return Decision(
                check_transition(job.job_id, state, target, detail, now),
                (ReleaseDevices(), Reschedule()),
            )
        case PreemptRequested(by=by, hold=hold):
            if hold and state in (JobState.PENDING, JobState.PREEMPTED):
                return Decision(check_transition(job.job_id, state, JobState.SUSPENDED, f"held by {by}", now))
            _require_running(job, "suspended" if hold else "preempted")
            verb = "suspend" if hold else "preempt"
            return Decision(
                actions=(Note(f"{verb} requested by {by}: checkpointing"), TakeCheckpoint(True, hold))
            )
        case ResumeRequested(by=by):
            if state is not JobState.SUSPENDED:
                raise InvalidTransition(f"job {job.job_id} is {state}; only a SUSPENDED job can be resumed")
            target = JobState.PREEMPTED if job.has_checkpoint else JobState.PENDING
            return Decision(
                check_transition(job.job_id, state, target, f"resumed by {by}; queued", now), (Reschedule(),)
            )
        case CheckpointRequested(by=by):
            _require_running(job, "checkpointed")
            return Decision(actions=(Note(f"checkpoint requested by {by}"), TakeCheckpoint(False)))
        case Checkpointed(summary=summary, stopped=stopped, hold=hold):
            if not stopped:
                return Decision(actions=(Note(summary),))
            if hold:
                target, reason = JobState.SUSPENDED, f"{summary}; held until resumed"
            else:
                target, reason = JobState.PREEMPTED, f"{summary}; queued to resume"
            return Decision(
                check_transition(job.job_id, state, target, reason, now), (ReleaseDevices(), Reschedule())
            )
        case CheckpointFailed(error=error):
            return Decision(actions=(Note(f"checkpoint failed, the job keeps running: {error}"),))
        case RestoreFailed(error=error):
            return Decision(
                check_transition(job.job_id, state, JobState.FAILED, f"cannot resume: {error}", now),
                (ReleaseDevices(), Reschedule()),
            )
        case Requeued(detail=detail):
            return Decision(
                check_transition(job.job_id, state, JobState.PENDING, detail, now),
                (ReleaseDevices(), Reschedule()),
            )
    raise TypeError(f"unknown stimulus {stimulus!r}")
