"""The pure scheduling policy and the round built from a cluster view: no I/O, microseconds each."""

from __future__ import annotations

from singularityd.core.actions import TakeCheckpoint
from singularityd.core.decisions import Activity
from singularityd.core.states import JobState
from singularityd.scheduling.policy import QueuedJob, RunningJob, plan_starts
from singularityd.scheduling.round import ClusterView, JobView, plan_round


def queued(job_id: int, wanted: int, priority: int = 0, tier: str = "standard") -> QueuedJob:
    return QueuedJob(job_id=job_id, priority=priority, submit_seq=job_id, devices_wanted=wanted, tier=tier)


def test_policy_priority_then_fifo() -> None:
    plan = plan_starts(
        [queued(1, 1), queued(2, 1, priority=5), queued(3, 1)], free_devices=[0, 1], total_devices=2
    )
    assert plan.starts == ((2, (0,)), (1, (1,)))
    assert plan.pending_reasons == {3: "Resources: needs 1 device, 0 free"}


def test_policy_gang_allocation_and_strict_queue() -> None:
    plan = plan_starts([queued(1, 3), queued(2, 1)], free_devices=[1, 3], total_devices=4)
    assert plan.starts == ()
    assert plan.pending_reasons == {
        1: "Resources: needs 3 devices, 2 free",
        2: "Priority: queued behind job 1",
    }
    plan = plan_starts([queued(1, 2), queued(2, 2)], free_devices=[0, 1, 2, 3], total_devices=4)
    assert plan.starts == ((1, (0, 1)), (2, (2, 3)))


def test_policy_never_overcommits_and_names_unsatisfiable_jobs() -> None:
    plan = plan_starts([queued(1, 5), queued(2, 1)], free_devices=[0], total_devices=4)
    assert plan.starts == ((2, (0,)),)
    assert plan.pending_reasons[1] == "Unsatisfiable: needs 5 devices, the machine has 4"
    granted = [
        d
        for _, devices in plan_starts([queued(i, 1) for i in range(10)], [0, 1, 2], 3).starts
        for d in devices
    ]
    assert sorted(granted) == [0, 1, 2]


def running(
    job_id: int,
    priority: int,
    devices: tuple[int, ...],
    started: float,
    stopping: bool = False,
    tier: str = "standard",
) -> RunningJob:
    return RunningJob(
        job_id=job_id, priority=priority, started_seq=started, devices=devices, stopping=stopping, tier=tier
    )


def test_policy_preempts_the_fewest_lowest_priority_jobs() -> None:
    busy = [running(1, 0, (0,), 1.0), running(2, 0, (1,), 2.0), running(3, 5, (2, 3), 3.0)]
    plan = plan_starts([queued(9, 1, priority=3)], [], 4, busy, can_preempt=True)
    assert plan.starts == () and plan.preemptions == (2,), "newest of the lowest priority goes first"
    assert plan.pending_reasons[9] == "Preempting: checkpointing lower-priority job(s) 2"
    plan = plan_starts([queued(9, 2, priority=3)], [], 4, busy, can_preempt=True)
    assert plan.preemptions == (2, 1)


def test_policy_never_preempts_equal_or_higher_priority_or_without_checkpoints() -> None:
    busy = [running(1, 3, (0, 1), 1.0)]
    plan = plan_starts([queued(9, 1, priority=3)], [], 2, busy, can_preempt=True)
    assert plan.preemptions == () and plan.pending_reasons[9] == "Resources: needs 1 device, 0 free"
    lower = [running(1, 0, (0, 1), 1.0)]
    assert plan_starts([queued(9, 1, priority=3)], [], 2, lower, can_preempt=False).preemptions == ()


def test_policy_orders_the_queue_by_tier_before_priority() -> None:
    plan = plan_starts(
        [queued(1, 1, priority=9, tier="basic"), queued(2, 1, priority=-3, tier="premium"), queued(3, 1, 5)],
        free_devices=[0, 1],
        total_devices=2,
    )
    assert plan.starts == ((2, (0,)), (3, (1,)))
    assert plan.pending_reasons == {1: "Resources: needs 1 device, 0 free"}


def test_policy_preempts_lower_tiers_whatever_their_priority_and_never_a_higher_tier() -> None:
    busy = [running(1, 100, (0,), 1.0, tier="basic"), running(2, 50, (1,), 2.0, tier="standard")]
    plan = plan_starts([queued(9, 1, priority=0, tier="premium")], [], 2, busy, can_preempt=True)
    assert plan.preemptions == (1,), "the lowest tier goes first, whatever its priority"
    assert plan.preempted_for == 9
    plan = plan_starts([queued(9, 2, priority=-7, tier="premium")], [], 2, busy, can_preempt=True)
    assert plan.preemptions == (1, 2)
    plan = plan_starts([queued(9, 1, priority=100, tier="basic")], [], 2, busy, can_preempt=True)
    assert plan.preemptions == () and plan.pending_reasons[9] == "Resources: needs 1 device, 0 free"
    assert plan.preempted_for == 0
    plan = plan_starts([queued(9, 1, priority=0, tier="standard")], [], 2, busy, can_preempt=True)
    assert plan.preemptions == (1,)


def test_a_tier_this_version_does_not_know_ranks_as_standard() -> None:
    plan = plan_starts([queued(1, 1, tier="platinum"), queued(2, 1, priority=1)], [0], 1)
    assert plan.starts == ((2, (0,)),)


def test_policy_waits_for_jobs_already_stopping() -> None:
    busy = [running(1, 0, (0,), 1.0, stopping=True), running(2, 0, (1,), 2.0)]
    plan = plan_starts([queued(9, 1, priority=3), queued(10, 1, priority=3)], [], 2, busy, can_preempt=True)
    assert plan.preemptions == ()
    assert plan.pending_reasons[9] == "Preempting: waiting for job(s) 1 to stop"
    assert plan.pending_reasons[10] == "Priority: queued behind job 9"


def test_round_starts_queued_jobs_on_the_devices_no_job_holds() -> None:
    view = ClusterView(
        devices=(0, 1, 2),
        jobs=(
            JobView(1, JobState.RUNNING, 0, 1, devices=(1,)),
            JobView(2, JobState.PENDING, 0, 2),
            JobView(3, JobState.SUSPENDED, 9, 1),
        ),
        now=0.0,
        can_preempt=True,
    )
    plan = plan_round(view)
    assert plan.starts == ((2, (0, 2)),)
    assert plan.preemptions == ()


def blocked_view(low: JobView, now: float = 0.0) -> ClusterView:
    """One device held by `low`; a higher-priority job waits for it."""
    return ClusterView((0,), (low, JobView(2, JobState.PENDING, 5, 1)), now, can_preempt=True)


def test_round_preempts_only_jobs_whose_processes_run_idle() -> None:
    idle = JobView(1, JobState.RUNNING, 0, 1, devices=(0,))
    assert plan_round(blocked_view(idle)).preemptions == (1,)
    launching = JobView(1, JobState.RUNNING, 0, 1, devices=(0,), activity=Activity(launching=True))
    assert plan_round(blocked_view(launching)).preemptions == ()
    in_place = Activity(checkpoint=TakeCheckpoint(stop=False))
    checkpointing = JobView(1, JobState.RUNNING, 0, 1, devices=(0,), activity=in_place)
    plan = plan_round(blocked_view(checkpointing))
    assert plan.preemptions == () and plan.pending_reasons[2] == "Resources: needs 1 device, 0 free"


def test_round_waits_for_a_job_already_stopping() -> None:
    stopping = Activity(checkpoint=TakeCheckpoint(stop=True))
    job = JobView(1, JobState.RUNNING, 0, 1, devices=(0,), activity=stopping)
    plan = plan_round(blocked_view(job))
    assert plan.preemptions == () and plan.pending_reasons[2] == "Preempting: waiting for job(s) 1 to stop"


def test_round_honours_a_preemption_back_off_until_it_has_passed() -> None:
    job = JobView(1, JobState.RUNNING, 0, 1, devices=(0,), activity=Activity(preemption_backoff_until=60.0))
    assert plan_round(blocked_view(job, now=59.0)).preemptions == ()
    assert plan_round(blocked_view(job, now=60.0)).preemptions == (1,)


def test_round_without_checkpoints_never_preempts() -> None:
    idle = JobView(1, JobState.RUNNING, 0, 1, devices=(0,))
    view = ClusterView((0,), (idle, JobView(2, JobState.PENDING, 5, 1)), 0.0, can_preempt=False)
    assert plan_round(view).preemptions == ()
