"""One scheduling round, decided from a view of the cluster: pure, no I/O.

The daemon builds a `ClusterView` from its store, the jobs' activities and its clock; a simulator
builds one from its own fleet and simulated time. Both get the same `Plan` from `plan_round`, so
the code a simulation exercises is the code the daemon runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from singularityd.core.jobs import Activity
from singularityd.core.states import JobState
from singularityd.scheduling.policy import Plan, QueuedJob, RunningJob, plan_starts
from singularityd.store import JobRecord


@dataclass(frozen=True)
class JobView:
    """One live job as a round sees it: what it wants, what it holds, what is under way."""

    job_id: int
    state: JobState
    priority: int
    devices_wanted: int
    devices: tuple[int, ...] = ()
    started_at: float = 0.0
    cancel_requested: bool = False
    activity: Activity = field(default_factory=Activity)

    @classmethod
    def of(cls, job: JobRecord, activity: Activity) -> JobView:
        """A stored job, with what is under way with its processes."""
        return cls(
            job.id,
            job.state,
            job.spec.priority,
            job.spec.gpus,
            job.devices,
            job.started_at or 0.0,
            job.cancel_requested,
            activity,
        )


@dataclass(frozen=True)
class ClusterView:
    """What a round decides from: the devices offered, the live jobs, the time, and whether
    running jobs can be preempted (checkpoints work)."""

    devices: tuple[int, ...]
    jobs: tuple[JobView, ...]
    now: float
    can_preempt: bool

    @property
    def queued(self) -> list[JobView]:
        """Jobs waiting for devices (new or preempted), in id order."""
        return [job for job in self.jobs if job.state.is_queued]


def _running(job: JobView, now: float) -> RunningJob:
    """A job holding devices as the policy sees it."""
    take = job.activity.checkpoint
    return RunningJob(
        job.job_id,
        job.priority,
        job.started_at,
        job.devices,
        stopping=job.cancel_requested or (take is not None and take.stop),
        preemptible=job.activity.preemptible_at(now),
    )


def plan_round(view: ClusterView) -> Plan:
    """Which queued jobs start where, which running jobs to preempt, why the others wait."""
    holding = [job for job in view.jobs if job.state.holds_devices]
    busy = {device for job in holding for device in job.devices}
    free = [device for device in view.devices if device not in busy]
    queue = [QueuedJob(job.job_id, job.priority, job.job_id, job.devices_wanted) for job in view.queued]
    running = [_running(job, view.now) for job in holding if job.state is JobState.RUNNING]
    return plan_starts(queue, free, len(view.devices), running, can_preempt=view.can_preempt)
