"""The scheduling policy: priority then FIFO, gang allocation, no overcommit. Pure, no I/O.

The daemon passes the queue and the free devices; the policy returns which jobs start on which
devices and, for every job left waiting, a reason a person can read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class QueuedJob:
    """A job waiting for devices, as the policy sees it."""

    job_id: int
    priority: int
    submit_seq: int
    devices_wanted: int


@dataclass(frozen=True)
class Plan:
    """What one scheduling round decided."""

    starts: tuple[tuple[int, tuple[int, ...]], ...] = ()
    pending_reasons: dict[int, str] = field(default_factory=dict)


def queue_order(job: QueuedJob) -> tuple[int, int]:
    """Higher priority first, then first come first served."""
    return (-job.priority, job.submit_seq)


def plan_starts(queue: Sequence[QueuedJob], free_devices: Sequence[int], total_devices: int) -> Plan:
    """Start jobs in priority-then-FIFO order while each gets all its devices at once.

    The queue is strict: once a job cannot start, the jobs behind it wait too, so a large job
    is never starved by a stream of small ones.
    """
    free = sorted(free_devices)
    starts: list[tuple[int, tuple[int, ...]]] = []
    reasons: dict[int, str] = {}
    blocker: QueuedJob | None = None
    for job in sorted(queue, key=queue_order):
        if job.devices_wanted > total_devices:
            reasons[job.job_id] = (
                f"Unsatisfiable: needs {job.devices_wanted} devices, the machine has {total_devices}"
            )
            continue
        if blocker is not None:
            reasons[job.job_id] = f"Priority: queued behind job {blocker.job_id}"
            continue
        if job.devices_wanted <= len(free):
            granted, free = tuple(free[: job.devices_wanted]), free[job.devices_wanted :]
            starts.append((job.job_id, granted))
            continue
        blocker = job
        reasons[job.job_id] = (
            f"Resources: needs {job.devices_wanted} device{'s' if job.devices_wanted != 1 else ''}, "
            f"{len(free)} free"
        )
    return Plan(tuple(starts), reasons)
