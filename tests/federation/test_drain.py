"""The order a drain moves a node's jobs in."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from singularityd.core.states import JobState, check_transition
from singularityd.federation.service import drain_order
from singularityd.store import Store
from tests.test_store import spec


def test_a_drain_moves_running_jobs_first_then_by_standing(tmp_path: Path) -> None:
    """A drain moved jobs by id, so a queued low-priority job could take the only room a peer had
    before a running high-priority one."""
    store = Store(tmp_path / "s.db")
    queued_low = store.create_job(replace(spec("queued-low"), priority=-5), at=1.0, reason="x")
    running_basic = store.create_job(replace(spec("running-basic"), tier="basic"), at=2.0, reason="x")
    running_high = store.create_job(replace(spec("running-high"), priority=9), at=3.0, reason="x")
    queued_premium = store.create_job(replace(spec("queued-premium"), tier="premium"), at=4.0, reason="x")
    for job in (running_basic, running_high):
        store.record_transition(check_transition(job.id, JobState.PENDING, JobState.RUNNING, "started", 5.0))
    order = [job.spec.name for job in drain_order(store.list_jobs())]
    assert order == ["running-high", "running-basic", "queued-premium", "queued-low"]
    assert queued_low.id < queued_premium.id
