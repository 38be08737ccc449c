"""The scheduling policy: tier, then priority, then FIFO; gang allocation, no overcommit, preemption.
Pure.

A round (singularityd.scheduling.round) passes the queue, the running jobs and the free devices;
the policy returns which jobs start on which devices, which running jobs to preempt (checkpoint
and stop) to make room for one that outranks them (singularityd/tiers.py), and, for every job left
waiting, a reason a person can read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from singularityd.tiers import DEFAULT_TIER, Ranked
from singularityd.units import counted


@dataclass(frozen=True)
class QueuedJob(Ranked):
    """A job waiting for devices, as the policy sees it."""

    job_id: int
    priority: int
    submit_seq: int
    devices_wanted: int
    devices_min: int = 0
    """An elastic job starts on fewer devices than it wants, not below this (0: not elastic)."""
    tier: str = DEFAULT_TIER


@dataclass(frozen=True)
class RunningJob(Ranked):
    """A job holding devices; `stopping` when it is already being preempted or cancelled."""

    job_id: int
    priority: int
    started_seq: float
    devices: tuple[int, ...]
    stopping: bool = False
    preemptible: bool = True
    tier: str = DEFAULT_TIER


@dataclass(frozen=True)
class Plan:
    """What one scheduling round decided."""

    starts: tuple[tuple[int, tuple[int, ...]], ...] = ()
    preemptions: tuple[int, ...] = ()
    pending_reasons: dict[int, str] = field(default_factory=dict)
    resizes: tuple[tuple[int, int], ...] = ()
    """Running elastic jobs to move to another number of devices: (job id, devices)."""
    preempted_for: int = 0
    """The queued job the preemptions make room for (0: none)."""


def queue_order(job: QueuedJob) -> tuple[int, int, int]:
    """Higher tier first, then higher priority, then first come first served."""
    tier, priority = job.standing
    return (-tier, -priority, job.submit_seq)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'s' if count != 1 else ''}"


def _victims(job: QueuedJob, running: Sequence[RunningJob], needed: int) -> list[RunningJob] | None:
    """The fewest jobs of a lower standing (lowest tier and priority, then most recently started)
    freeing `needed`."""
    candidates = sorted(
        (r for r in running if r.preemptible and not r.stopping and r.standing < job.standing),
        key=lambda r: (r.standing, -r.started_seq),
    )
    chosen: list[RunningJob] = []
    freed = 0
    for candidate in candidates:
        if freed >= needed:
            break
        chosen.append(candidate)
        freed += len(candidate.devices)
    return chosen if freed >= needed else None


def plan_starts(
    queue: Sequence[QueuedJob],
    free_devices: Sequence[int],
    total_devices: int,
    running: Sequence[RunningJob] = (),
    can_preempt: bool = False,
) -> Plan:
    """Start jobs in tier-then-priority-then-FIFO order while each gets all its devices at once.

    The queue is strict: once a job cannot start, the jobs behind it wait too, so a large job
    is never starved by a stream of small ones. An elastic job starts on as many free devices as
    it wants or, when fewer are free, on all of them if that reaches its minimum. When the
    blocked job outranks running jobs (a higher tier, or the same tier and a higher priority) and
    preemption is possible, the policy preempts the fewest of those jobs that make room.
    """
    free = sorted(free_devices)
    starts: list[tuple[int, tuple[int, ...]]] = []
    preemptions: list[int] = []
    reasons: dict[int, str] = {}
    blocker: QueuedJob | None = None
    for job in sorted(queue, key=queue_order):
        if job.devices_wanted > total_devices:
            reasons[job.job_id] = (
                f"Unsatisfiable: needs {counted(job.devices_wanted, 'device')}, "
                f"the machine has {total_devices}"
            )
            continue
        if blocker is not None:
            reasons[job.job_id] = f"Priority: queued behind job {blocker.job_id}"
            continue
        if job.devices_wanted <= len(free) or 0 < job.devices_min <= len(free):
            count = min(job.devices_wanted, len(free))
            granted, free = tuple(free[:count]), free[count:]
            starts.append((job.job_id, granted))
            continue
        blocker = job
        stopping = [r for r in running if r.stopping]
        soon_free = len(free) + sum(len(r.devices) for r in stopping)
        if soon_free >= job.devices_wanted and stopping:
            waiting = ",".join(str(r.job_id) for r in stopping)
            reasons[job.job_id] = f"Preempting: waiting for job(s) {waiting} to stop"
            continue
        victims = _victims(job, running, job.devices_wanted - soon_free) if can_preempt else None
        if victims:
            preemptions += [v.job_id for v in victims]
            listed = ",".join(str(v.job_id) for v in victims)
            reasons[job.job_id] = f"Preempting: checkpointing lower-priority job(s) {listed}"
            continue
        reasons[job.job_id] = f"Resources: needs {_plural(job.devices_wanted, 'device')}, {len(free)} free"
    preempted_for = blocker.job_id if preemptions and blocker is not None else 0
    return Plan(tuple(starts), tuple(preemptions), reasons, preempted_for=preempted_for)
