"""Elastic jobs: growing them into idle devices and shrinking them, within their range, before
anything is preempted. Pure, no I/O.

An elastic job runs on any number of devices between its `min_devices` and `max_devices` (its
ranks see no change: devices/splicing.py); the daemon carries a change out as a resize
(checkpoint, stop, restore on the new count). The policy runs after `plan_starts`: when the
queue's first blocked job needs devices, elastic jobs of lower or equal standing (tier, then
priority: singularityd/tiers.py) give up devices (lowest standing first, most recently started
first, down to their minimum) instead of being preempted; when nothing waits, idle devices go to
elastic jobs below their maximum (highest standing first, one device at a time in turn, so they
grow evenly).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from singularityd.tiers import DEFAULT_TIER, Ranked


@dataclass(frozen=True)
class ElasticJob(Ranked):
    """A running elastic job as the policy sees it; `busy` while a checkpoint or resize is under way."""

    job_id: int
    priority: int
    started_seq: float
    devices: int
    min_devices: int
    max_devices: int
    busy: bool = False
    tier: str = DEFAULT_TIER


@dataclass(frozen=True)
class Resize:
    """Move a running elastic job to `devices` devices."""

    job_id: int
    devices: int


def shrink_for(needed: int, rank: tuple[int, int], jobs: Sequence[ElasticJob]) -> tuple[Resize, ...] | None:
    """The resizes that free `needed` devices for a job of standing `rank` from elastic jobs of no
    higher standing, or None when they cannot (then preemption decides)."""
    candidates = sorted(
        (j for j in jobs if not j.busy and j.standing <= rank and j.devices > j.min_devices),
        key=lambda j: (j.standing, -j.started_seq),
    )
    resizes = []
    freed = 0
    for job in candidates:
        if freed >= needed:
            break
        give = min(job.devices - job.min_devices, needed - freed)
        resizes.append(Resize(job.job_id, job.devices - give))
        freed += give
    return tuple(resizes) if freed >= needed else None


def grow_into(idle: int, jobs: Sequence[ElasticJob]) -> tuple[Resize, ...]:
    """The resizes that give `idle` devices to elastic jobs below their maximum, in turn."""
    order = sorted(
        (j for j in jobs if not j.busy and j.devices < j.max_devices),
        key=lambda j: (-j.standing[0], -j.standing[1], j.started_seq),
    )
    sizes = {job.job_id: job.devices for job in order}
    left = idle
    while left > 0:
        grew = False
        for job in order:
            if left > 0 and sizes[job.job_id] < job.max_devices:
                sizes[job.job_id] += 1
                left -= 1
                grew = True
        if not grew:
            break
    return tuple(Resize(job.job_id, sizes[job.job_id]) for job in order if sizes[job.job_id] != job.devices)


def plan_elastic(
    jobs: Sequence[ElasticJob], free: int, blocked: tuple[int, tuple[int, int]] | None
) -> tuple[Resize, ...] | None:
    """What to do with elastic jobs this round: shrink them for the blocked job (`needed` devices
    beyond the free ones, its standing), or grow them into free devices when nothing is blocked.
    None when a blocked job cannot be served by shrinking (preemption decides)."""
    if blocked is not None:
        needed, rank = blocked
        return shrink_for(max(0, needed - free), rank, jobs)
    return grow_into(free, jobs)
