"""Splicing only data-parallel replicas (pure): when to ask, what to do with a refusal, and how a
refused job is scheduled and resized from then on."""

from __future__ import annotations

from dataclasses import replace

import pytest

from singularityd.core.decisions import Activity
from singularityd.core.states import JobState
from singularityd.errors import InvalidRequest
from singularityd.jobs.submission import check_resize
from singularityd.scheduling.replicas import (
    Unsplice,
    device_range,
    pending_reason,
    resize_refusal,
    unsplice,
    wants_verdict,
)
from singularityd.scheduling.round import ClusterView, JobView, plan_round
from singularityd.store import JobRecord, JobSpec

WHY = "ranks 0 and 1 hold different parameters: not data-parallel replicas"


def test_only_a_spliced_idle_job_not_yet_refused_is_asked() -> None:
    """Ranks sharing devices, nothing under way, no refusal yet: ask; otherwise not."""
    assert wants_verdict(ranks=4, devices=2, refusal="", idle=True)
    assert not wants_verdict(ranks=4, devices=4, refusal="", idle=True), "one rank per device"
    assert not wants_verdict(ranks=4, devices=2, refusal="", idle=False), "a checkpoint is under way"
    assert not wants_verdict(ranks=4, devices=2, refusal=WHY, idle=True), "already refused"
    assert not wants_verdict(ranks=4, devices=0, refusal="", idle=True), "holds no devices"


def test_a_refused_job_is_resized_when_one_device_per_rank_is_free_counting_its_own() -> None:
    """Its own devices count: 1 held and 1 free make 2 for 2 ranks; otherwise it waits for them."""
    assert unsplice(ranks=2, held=1, free=1) == Unsplice(2, now=True)
    assert unsplice(ranks=4, held=2, free=1) == Unsplice(4, now=False)
    assert unsplice(ranks=2, held=1, free=0) == Unsplice(2, now=False)
    assert (
        Unsplice(2, True).describe(WHY) == f"splicing refused: {WHY}; resizing it to 2 devices, one per rank"
    )
    assert Unsplice(4, False).describe(WHY) == (
        f"splicing refused: {WHY}; checkpointing it until 4 devices, one per rank, are free"
    )


def test_a_refused_jobs_range_starts_at_its_ranks() -> None:
    """An elastic job once refused never goes below its rank count; others keep their range."""
    assert device_range(4, 1, 4, "") == (1, 4)
    assert device_range(4, 1, 4, WHY) == (4, 4)
    assert device_range(4, 1, 2, WHY) == (4, 4)
    assert device_range(4, 0, 0, WHY) == (0, 0), "not elastic"


def test_a_resize_below_the_ranks_of_a_refused_job_is_refused_with_the_reason() -> None:
    """Fewer devices than ranks: refused with why; as many: allowed; an unrefused job: allowed."""
    assert resize_refusal(7, 2, 1, WHY) == f"job 7's 2 ranks need one device each ({WHY})"
    assert resize_refusal(7, 2, 2, WHY) == ""
    assert resize_refusal(7, 2, 1, "") == ""


def test_a_waiting_refused_jobs_pending_reason_says_why_it_needs_that_many() -> None:
    """Resources and Unsatisfiable reasons get the refusal; others and unrefused jobs do not."""
    assert pending_reason("Resources: needs 2 devices, 1 free", WHY) == (
        f"Resources: needs 2 devices, 1 free (one per rank: {WHY})"
    )
    assert pending_reason("Priority: queued behind job 3", WHY) == "Priority: queued behind job 3"
    assert pending_reason("Resources: needs 2 devices, 1 free", "") == "Resources: needs 2 devices, 1 free"


def record(
    job_id: int, state: JobState, gpus: int, ranks: int, refusal: str, low: int = 0, high: int = 0
) -> JobRecord:
    """A stored job of `ranks` ranks asking for `gpus` devices."""
    spec = JobSpec(
        f"j{job_id}", 0, 0, "root", 0, gpus, ranks, ("train",), {}, "/", min_gpus=low, max_gpus=high
    )
    return JobRecord(
        job_id,
        spec,
        state,
        "",
        "",
        False,
        0.0,
        None,
        None,
        None,
        None,
        None,
        None,
        0,
        None,
        None,
        (),
        0,
        refusal,
    )


def test_a_queued_refused_job_waits_for_one_device_per_rank_saying_why() -> None:
    """Preempted while asking for 1 device, a refused 2-rank job wants 2 and says why it waits."""
    held = JobView(1, JobState.RUNNING, 0, 1, devices=(0,))
    waiting = JobView.of(record(2, JobState.PREEMPTED, 1, 2, WHY), Activity())
    assert waiting.devices_wanted == 2
    plan = plan_round(ClusterView((0, 1), (held, waiting), 0.0, can_preempt=True))
    assert plan.starts == ()
    assert plan.pending_reasons[2] == f"Resources: needs 2 devices, 1 free (one per rank: {WHY})"
    plan = plan_round(ClusterView((0, 1), (waiting,), 0.0, can_preempt=True))
    assert plan.starts == ((2, (0, 1)),)


def test_a_refused_elastic_job_is_not_shrunk_below_its_ranks() -> None:
    """An elastic 2-rank job (range 1-2) once refused gives no device to a waiting job."""
    running = replace(
        JobView.of(record(1, JobState.RUNNING, 2, 2, WHY, low=1, high=2), Activity()), devices=(0, 1)
    )
    waiting = JobView(2, JobState.PENDING, 0, 1)
    plan = plan_round(ClusterView((0, 1), (running, waiting), 0.0, can_preempt=True))
    assert plan.resizes == ()
    unrefused = replace(running, min_devices=1, splice_refusal="")
    assert plan_round(ClusterView((0, 1), (unrefused, waiting), 0.0, can_preempt=True)).resizes == ((1, 1),)


def test_check_resize_refuses_splicing_a_refused_job() -> None:
    """`sing resize` below the ranks of a refused job: InvalidRequest naming the reason."""
    job = record(3, JobState.RUNNING, 2, 2, WHY)
    with pytest.raises(InvalidRequest, match="cannot splice: job 3's 2 ranks need one device each"):
        check_resize(job, 1, total_devices=2)
    check_resize(record(3, JobState.RUNNING, 2, 2, ""), 1, total_devices=2)
