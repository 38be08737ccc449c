"""One scheduling round, decided from a view of the cluster: pure, no I/O.

The daemon builds a `ClusterView` from its store, the jobs' activities and its clock; a simulator
builds one from its own fleet and simulated time. Both get the same `Plan` from `plan_round`, so
the code a simulation exercises is the code the daemon runs.

Elastic jobs (scheduling/elastic.py) are fitted in after the starts: when the first blocked job
can be served by shrinking running elastic jobs within their ranges, they are resized instead of
anything being preempted; when nothing waits and devices have been idle for `grow_after`
seconds, the elastic jobs grow into them. Nothing elastic happens while a job is stopping (its
devices are about to come free), so one change settles before the next is decided.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from singularityd.core.decisions import Activity
from singularityd.core.states import JobState
from singularityd.scheduling.elastic import ElasticJob, plan_elastic
from singularityd.scheduling.policy import Plan, QueuedJob, RunningJob, plan_starts, queue_order
from singularityd.scheduling.replicas import device_range, pending_reason
from singularityd.store import JobRecord
from singularityd.tiers import DEFAULT_TIER


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
    min_devices: int = 0
    max_devices: int = 0
    """An elastic job's range of devices (both 0: not elastic)."""
    splice_refusal: str = ""
    """Why the job's ranks may not share devices ('' when they may; scheduling/replicas.py)."""
    tier: str = DEFAULT_TIER

    @classmethod
    def of(cls, job: JobRecord, activity: Activity) -> JobView:
        """A stored job, with what is under way with its processes (a job whose ranks may not share
        devices has a range that starts at its rank count)."""
        spec, refusal = job.spec, job.splice_refusal
        low, high = device_range(spec.ranks, spec.min_gpus, spec.max_gpus, refusal)
        return cls(
            job.id,
            job.state,
            spec.priority,
            max(spec.gpus, spec.ranks) if refusal else spec.gpus,
            job.devices,
            job.started_at or 0.0,
            job.cancel_requested,
            activity,
            low,
            high,
            refusal,
            spec.tier,
        )


@dataclass(frozen=True)
class ClusterView:
    """What a round decides from: the devices offered, the live jobs, the time, and whether
    running jobs can be preempted (checkpoints work)."""

    devices: tuple[int, ...]
    jobs: tuple[JobView, ...]
    now: float
    can_preempt: bool
    idle_since: float | None = None
    """Since when some devices have been free with nothing queued (None: not so now)."""
    grow_after: float = 0.0
    """How long devices stay idle before elastic jobs grow into them."""
    reserved: frozenset[int] = frozenset()
    """Devices held for jobs arriving from peers (their device state preloaded), which no job here
    may take meanwhile."""

    @property
    def queued(self) -> list[JobView]:
        """Jobs waiting for devices (new or preempted), in id order."""
        return [job for job in self.jobs if job.state.is_queued]

    @property
    def idle_long_enough(self) -> bool:
        """Whether devices have been idle, with nothing queued, for `grow_after` seconds."""
        return self.idle_since is not None and self.now - self.idle_since >= self.grow_after

    @property
    def free_devices(self) -> list[int]:
        """The offered devices no live job holds and none is reserved for an arriving job."""
        busy = {device for job in self.jobs if job.state.holds_devices for device in job.devices}
        return [device for device in self.devices if device not in busy and device not in self.reserved]


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
        tier=job.tier,
    )


def _elastic(job: JobView, now: float) -> ElasticJob:
    """A running elastic job as the elastic policy sees it."""
    busy = job.cancel_requested or not job.activity.preemptible_at(now)
    return ElasticJob(
        job.job_id,
        job.priority,
        job.started_at,
        len(job.devices),
        job.min_devices,
        job.max_devices,
        busy,
        job.tier,
    )


def _fit_elastic(view: ClusterView, plan: Plan, queue: list[QueuedJob], running: list[RunningJob]) -> Plan:
    """The plan with elastic jobs shrunk for the first blocked job (instead of preempting) or
    grown into devices idle long enough; unchanged while any job is stopping or checkpoints
    (which a resize takes) are unavailable."""
    elastic = [
        _elastic(job, view.now) for job in view.jobs if job.state is JobState.RUNNING and job.max_devices
    ]
    if not elastic or not view.can_preempt or any(r.stopping for r in running):
        return plan
    started = dict(plan.starts)
    free = len(view.free_devices) - sum(len(devices) for devices in started.values())
    waiting = [job for job in sorted(queue, key=queue_order) if job.job_id not in started]
    blocked = next((job for job in waiting if not plan.pending_reasons[job.job_id].startswith("Unsat")), None)
    if blocked is None and not view.idle_long_enough:
        return plan
    wants = None if blocked is None else (blocked.devices_wanted, blocked.standing)
    changes = plan_elastic(elastic, free, wants)
    if not changes:
        return plan
    resizes = tuple((change.job_id, change.devices) for change in changes)
    if blocked is None:
        return replace(plan, resizes=resizes)
    listed = ",".join(str(change.job_id) for change in changes)
    reasons = {**plan.pending_reasons, blocked.job_id: f"Resources: shrinking elastic job(s) {listed}"}
    return replace(plan, preemptions=(), preempted_for=0, pending_reasons=reasons, resizes=resizes)


def plan_round(view: ClusterView) -> Plan:
    """Which queued jobs start where, which running jobs to preempt or resize, why the others wait."""
    queue = [
        QueuedJob(job.job_id, job.priority, job.job_id, job.devices_wanted, job.min_devices, job.tier)
        for job in view.queued
    ]
    running = [_running(job, view.now) for job in view.jobs if job.state is JobState.RUNNING]
    plan = plan_starts(queue, view.free_devices, len(view.devices), running, can_preempt=view.can_preempt)
    plan = _fit_elastic(view, plan, queue, running)
    refusals = {job.job_id: job.splice_refusal for job in view.queued if job.splice_refusal}
    if not refusals:
        return plan
    reasons = {job: pending_reason(why, refusals.get(job, "")) for job, why in plan.pending_reasons.items()}
    return replace(plan, pending_reasons=reasons)
