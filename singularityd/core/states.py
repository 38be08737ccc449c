"""Job states and the transitions allowed between them: pure, no I/O."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class JobState(enum.StrEnum):
    """The states a job passes through; the terminal ones never change again.

    MIGRATING: a hand-off between peer daemons decides where the job runs. On the source it is
    stopped with its final checkpoint on the way to the target (no processes, no devices); on the
    target its devices are reserved and, once restored, its processes are held frozen until the
    commit. MOVED: the job lives on another node now; this node keeps its record (a job that
    comes back takes it up again) but never runs it.
    """

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"
    PREEMPTED = "PREEMPTED"
    MIGRATING = "MIGRATING"
    MOVED = "MOVED"
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
        """Whether the job may own devices in this state (RUNNING; MIGRATING where reserved)."""
        return self in (JobState.RUNNING, JobState.MIGRATING)

    @property
    def is_listed(self) -> bool:
        """Whether a listing of live jobs shows it (not ended, not living on another node)."""
        return not self.is_terminal and self is not JobState.MOVED


TERMINAL_STATES = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED})
QUEUED_STATES = frozenset({JobState.PENDING, JobState.PREEMPTED})

ALLOWED_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset(
        {JobState.RUNNING, JobState.SUSPENDED, JobState.CANCELLED, JobState.FAILED, JobState.MIGRATING}
    ),
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
        {JobState.PENDING, JobState.PREEMPTED, JobState.CANCELLED, JobState.FAILED, JobState.MIGRATING}
    ),
    JobState.PREEMPTED: frozenset(
        {JobState.RUNNING, JobState.SUSPENDED, JobState.CANCELLED, JobState.FAILED, JobState.MIGRATING}
    ),
    JobState.MIGRATING: frozenset(
        {
            JobState.RUNNING,
            JobState.PENDING,
            JobState.PREEMPTED,
            JobState.SUSPENDED,
            JobState.MOVED,
            JobState.COMPLETED,
            JobState.FAILED,
            JobState.CANCELLED,
        }
    ),
    JobState.MOVED: frozenset({JobState.MIGRATING}),
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


def was_suspended_when_set_aside(history: Iterable[tuple[str | None, str]]) -> bool:
    """Whether a job's history ((from state, to state) per event, oldest first) shows it suspended
    when it was last set aside for a move: it stays suspended wherever it lands. Arrivals (from no
    state, or from MOVED where it lived before) and notes are not set-asides."""
    skipped = (None, JobState.MIGRATING.value, JobState.MOVED.value)
    for from_state, to_state in reversed(list(history)):
        if to_state == JobState.MIGRATING.value and from_state not in skipped:
            return bool(from_state == JobState.SUSPENDED.value)
    return False
