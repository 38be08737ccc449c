"""The elastic policy (pure): grow into idle devices, shrink within range before preempting."""

from __future__ import annotations

from dataclasses import replace

from singularityd.core.actions import TakeCheckpoint
from singularityd.core.decisions import Activity
from singularityd.core.states import JobState
from singularityd.scheduling.elastic import ElasticJob, Resize, grow_into, plan_elastic, shrink_for
from singularityd.scheduling.round import ClusterView, JobView, plan_round
from singularityd.tiers import standing


def outranking(priority: int) -> tuple[int, int]:
    """The standing of a standard-tier job of `priority`."""
    return standing("standard", priority)


def job(
    job_id: int, devices: int, low: int = 1, high: int = 4, priority: int = 0, seq: float = 0.0
) -> ElasticJob:
    """An elastic job holding `devices`, with range [low, high]."""
    return ElasticJob(job_id, priority, seq or float(job_id), devices, low, high)


def test_an_elastic_job_grows_into_idle_devices_up_to_its_maximum() -> None:
    """Idle devices go to an elastic job, never beyond its maximum."""
    assert grow_into(3, [job(1, 1, high=3)]) == (Resize(1, 3),)
    assert grow_into(1, [job(1, 3, high=3)]) == ()


def test_idle_devices_are_shared_in_turn_highest_priority_first() -> None:
    """Two elastic jobs grow one device at a time each, the higher priority first."""
    jobs = [job(1, 1, priority=0), job(2, 1, priority=5)]
    assert grow_into(3, jobs) == (Resize(2, 3), Resize(1, 2))


def test_a_busy_job_is_left_alone() -> None:
    """A job whose checkpoint or resize is under way is neither grown nor shrunk."""
    busy = ElasticJob(1, 0, 1.0, 1, 1, 4, busy=True)
    assert grow_into(2, [busy]) == ()
    assert shrink_for(1, outranking(0), [busy]) is None


def test_shrinking_frees_what_the_blocked_job_needs_within_the_range() -> None:
    """Shrinking frees exactly what is needed, never below the minimum."""
    assert shrink_for(2, outranking(0), [job(1, 4, low=1)]) == (Resize(1, 2),)
    assert shrink_for(3, outranking(0), [job(1, 4, low=2)]) is None


def test_shrinking_takes_the_lowest_priority_then_the_newest_first() -> None:
    """The lowest-priority, most recently started elastic jobs give devices first."""
    jobs = [job(1, 2, priority=1), job(2, 2, priority=0, seq=1.0), job(3, 2, priority=0, seq=9.0)]
    assert shrink_for(1, outranking(5), jobs) == (Resize(3, 1),)
    assert shrink_for(3, outranking(5), jobs) == (Resize(3, 1), Resize(2, 1), Resize(1, 1))


def test_a_higher_priority_elastic_job_is_not_shrunk_for_a_lower_one() -> None:
    """A queued job never shrinks an elastic job that outranks it."""
    assert shrink_for(1, outranking(0), [job(1, 4, priority=3)]) is None


def test_tiers_outrank_priorities_in_shrinking_and_growing() -> None:
    """A premium job shrinks a standard one of any priority, never the other way round; idle
    devices go to the premium job first."""
    standard = replace(job(1, 4, priority=9), tier="standard")
    premium = replace(job(2, 4, priority=-5), tier="premium")
    assert shrink_for(1, standing("premium", -9), [standard]) == (Resize(1, 3),)
    assert shrink_for(1, standing("standard", 9), [premium]) is None
    assert shrink_for(1, standing("basic", 100), [standard]) is None
    small = [replace(standard, devices=1), replace(premium, devices=1)]
    assert grow_into(1, small) == (Resize(2, 2),)


def test_plan_shrinks_for_a_blocked_job_and_grows_otherwise() -> None:
    """A round shrinks for the blocked job, grows when nothing waits, else leaves it to preemption."""
    jobs = [job(1, 2, low=1, high=4)]
    assert plan_elastic(jobs, free=2, blocked=None) == (Resize(1, 4),)
    assert plan_elastic(jobs, free=0, blocked=(1, outranking(0))) == (Resize(1, 1),)
    assert plan_elastic(jobs, free=1, blocked=(1, outranking(0))) == ()
    assert plan_elastic(jobs, free=0, blocked=(4, outranking(0))) is None


DEVICES = (0, 1, 2, 3)


def elastic_job(job_id: int, devices: tuple[int, ...], activity: Activity | None = None) -> JobView:
    """A running elastic 4-rank job (range 1-4) holding `devices`."""
    return JobView(
        job_id,
        JobState.RUNNING,
        0,
        len(devices),
        devices=devices,
        activity=activity or Activity(),
        min_devices=1,
        max_devices=4,
    )


def test_a_round_shrinks_an_elastic_job_for_a_waiting_one_instead_of_preempting_it() -> None:
    """A higher-priority job needing 2 of 4 held devices gets them by a resize to 2, not a preemption."""
    view = ClusterView(
        DEVICES, (elastic_job(1, DEVICES), JobView(2, JobState.PENDING, 5, 2)), 0.0, can_preempt=True
    )
    plan = plan_round(view)
    assert (plan.resizes, plan.preemptions) == (((1, 2),), ())
    assert plan.pending_reasons[2] == "Resources: shrinking elastic job(s) 1"


def test_a_round_grows_an_elastic_job_only_once_devices_have_been_idle_long_enough() -> None:
    """Idle devices go to the elastic job after `grow_after` seconds with nothing queued."""
    jobs = (elastic_job(1, (0,)),)
    early = ClusterView(DEVICES, jobs, 10.0, can_preempt=True, idle_since=8.0, grow_after=5.0)
    assert plan_round(early).resizes == ()
    due = replace(early, now=13.0)
    assert plan_round(due).resizes == ((1, 4),)
    assert plan_round(replace(due, idle_since=None)).resizes == ()
    assert plan_round(replace(due, can_preempt=False)).resizes == ()


def test_a_round_leaves_elastic_jobs_alone_while_a_job_is_stopping() -> None:
    """While one resize's checkpoint is under way, no other change is decided."""
    stopping = Activity(checkpoint=TakeCheckpoint(True))
    view = ClusterView(
        DEVICES,
        (elastic_job(1, (0, 1), stopping), elastic_job(3, (2,)), JobView(2, JobState.PENDING, 0, 2)),
        0.0,
        can_preempt=True,
    )
    assert plan_round(view).resizes == ()


def test_a_queued_elastic_job_starts_on_the_devices_free_when_they_reach_its_minimum() -> None:
    """Wanting 4 with 2 free and a minimum of 1, an elastic job starts on the 2."""
    held = JobView(1, JobState.RUNNING, 0, 2, devices=(0, 1))
    elastic = JobView(2, JobState.PENDING, 0, 4, min_devices=1, max_devices=4)
    assert plan_round(ClusterView(DEVICES, (held, elastic), 0.0, can_preempt=True)).starts == ((2, (2, 3)),)
    rigid = JobView(2, JobState.PENDING, 0, 4)
    assert plan_round(ClusterView(DEVICES, (held, rigid), 0.0, can_preempt=True)).starts == ()


def test_devices_reserved_for_an_arriving_job_are_neither_started_on_nor_grown_into() -> None:
    """Devices holding an arriving job's preloaded state count for the machine's size, but no queued
    job starts on them and no elastic job grows into them."""
    reserved = frozenset({2, 3})
    queued = JobView(2, JobState.PENDING, 0, 2)
    view = ClusterView(
        DEVICES,
        (JobView(1, JobState.RUNNING, 0, 2, devices=(0, 1)), queued),
        0.0,
        can_preempt=True,
        reserved=reserved,
    )
    plan = plan_round(view)
    assert plan.starts == ()
    assert not plan.pending_reasons[2].startswith("Unsatisfiable")
    assert plan_round(replace(view, reserved=frozenset())).starts == ((2, (2, 3)),)
    idle = ClusterView(DEVICES, (elastic_job(1, (0,)),), 13.0, True, idle_since=8.0, grow_after=5.0)
    assert plan_round(replace(idle, reserved=reserved)).resizes == ((1, 2),)
