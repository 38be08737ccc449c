"""The SQLite store: jobs, event log and device assignments survive reopening."""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from pathlib import Path

from singularityd.core.states import JobState, check_transition
from singularityd.store import JobSpec, Store
from singularityd.store.schema import ADDED_COLUMNS


def spec(name: str = "train") -> JobSpec:
    return JobSpec(
        name=name, uid=1000, gid=1000, user="alice", priority=0, gpus=2, ranks=1,
        command=("python", "train.py"), env={"A": "1"}, cwd="/tmp",
    )  # fmt: skip


def test_job_lifecycle_is_durable(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    job = store.create_job(spec(), at=10.0, reason="submitted by alice")
    assert job.state is JobState.PENDING and job.id == 1
    store.record_transition(
        check_transition(1, JobState.PENDING, JobState.RUNNING, "started", 11.0), devices=(2, 3)
    )
    store.set_process(1, pid=4242, start_ticks=99)
    store.close()

    reopened = Store(tmp_path / "s.db")
    job2 = reopened.get(1)
    assert job2 is not None
    assert (job2.state, job2.devices, job2.init_pid, job2.attempt, job2.started_at) == (
        JobState.RUNNING, (2, 3), 4242, 1, 11.0,
    )  # fmt: skip
    assert job2.spec == spec()
    assert reopened.busy_devices() == {2: 1, 3: 1}
    reopened.record_transition(
        check_transition(1, JobState.RUNNING, JobState.FAILED, "exited with code 3", 12.0), exit_code=3
    )
    done = reopened.get(1)
    assert done is not None
    assert (done.state, done.exit_code, done.ended_at, done.devices, done.init_pid) == (
        JobState.FAILED, 3, 12.0, (), None,
    )  # fmt: skip
    assert [(e.from_state, e.to_state, e.reason) for e in reopened.events(1)] == [
        (None, JobState.PENDING, "submitted by alice"),
        (JobState.PENDING, JobState.RUNNING, "started"),
        (JobState.RUNNING, JobState.FAILED, "exited with code 3"),
    ]
    assert reopened.list_jobs() == []
    assert [j.id for j in reopened.list_jobs(include_finished=True)] == [1]


def test_pending_reasons_and_listing(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    for index in range(3):
        store.create_job(spec(f"j{index}"), at=float(index), reason="submitted")
    store.set_pending_reasons({2: "Resources: needs 2 devices, 0 free"})
    jobs = store.list_jobs(states=(JobState.PENDING,))
    assert [j.id for j in jobs] == [1, 2, 3]
    assert jobs[1].pending_reason == "Resources: needs 2 devices, 0 free"


def test_a_database_from_before_a_column_gets_it_and_keeps_its_jobs(tmp_path: Path) -> None:
    """A database whose jobs table predates the added columns gets them on open, with defaults
    that keep its jobs' behaviour (not elastic, no refusal, the standard tier)."""
    path = tmp_path / "old.db"
    store = Store(path)
    store.create_job(replace(spec(), tier="premium"), at=10.0, reason="submitted by alice")
    store.close()
    db = sqlite3.connect(path)
    for column in ADDED_COLUMNS:
        db.execute(f"ALTER TABLE jobs DROP COLUMN {column}")
    db.commit()
    db.close()

    reopened = Store(path)
    job = reopened.get(1)
    assert job is not None and job.spec == spec() and job.spec.tier == "standard"
    added = reopened.create_job(replace(spec("next"), tier="basic", max_gpus=2, min_gpus=1), 11.0, "again")
    assert (added.spec.tier, added.spec.min_gpus, added.spec.max_gpus) == ("basic", 1, 2)


def test_a_job_that_left_for_a_peer_ended_here_and_takes_no_time_on_when_it_comes_back(
    tmp_path: Path,
) -> None:
    """`sing ps -a` on the node a job left showed its TIME growing for ever (no end time)."""
    store = Store(tmp_path / "s.db")
    store.create_job(spec(), at=10.0, reason="submitted by alice")
    for source, target, at in [(JobState.PENDING, JobState.RUNNING, 11.0),
                               (JobState.RUNNING, JobState.MIGRATING, 20.0),
                               (JobState.MIGRATING, JobState.MOVED, 21.0)]:  # fmt: skip
        store.record_transition(check_transition(1, source, target, "x", at))
    moved = store.get(1)
    assert moved is not None and moved.ended_at == 21.0
    exported = store.export_job(1)
    exported["job"]["ended_at"] = None  # as the peer it runs on holds it
    back = store.import_job(exported, "arriving from node-b", 30.0)
    assert back.state is JobState.MIGRATING and back.ended_at is None
