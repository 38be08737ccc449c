"""Restarts after failures (`sing submit --max-restarts K`), torchrun-style.

The decision is pure (microseconds): a failed job with restarts left is queued to resume from its
newest complete checkpoint, or with none to start again from its command; with none left it fails
saying so. Through the real daemon: a 2-rank DDP job whose rank 1 is killed once after a checkpoint
finishes with every rank's losses and final weights byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path

import pytest

from singularityd.core.actions import CountRestart, ReleaseDevices, Reschedule
from singularityd.core.decisions import Decision, JobFacts, decide
from singularityd.core.states import JobState
from singularityd.core.stimuli import Exited, ProcessesLost
from singularityd.store import Store
from tests.helpers import Daemon, wait_until
from tests.proxy.conftest import PROGRAMS, PYTHON
from tests.test_collectives import printed, rank_logs, run_job, succeeded

RANK_KILLED = "rank 1 was killed by signal 9; the other ranks were stopped"
RANK_EXITED = "rank 1 exited with code 3; the other ranks were stopped"


def failed_job(
    max_restarts: int, used: int = 0, *, checkpoint: int | None = None, cancel: bool = False
) -> JobFacts:
    """A RUNNING job with these restarts, and a complete checkpoint numbered `checkpoint` if given."""
    return JobFacts(
        1,
        JobState.RUNNING,
        cancel,
        has_checkpoint=checkpoint is not None,
        max_restarts=max_restarts,
        restarts_used=used,
        last_checkpoint=checkpoint,
    )


def ended(decision: Decision) -> tuple[JobState, str]:
    """The state a decision moves the job to, and why."""
    assert decision.transition is not None
    return decision.transition.to_state, decision.transition.reason


KILLED = Exited(None, 9, RANK_KILLED)


def test_a_failure_with_restarts_left_resumes_from_the_newest_checkpoint() -> None:
    decision = decide(failed_job(2, checkpoint=3), KILLED, 0)
    assert ended(decision) == (
        JobState.PREEMPTED,
        f"{RANK_KILLED}; restoring from checkpoint 3 (restart 1 of 2)",
    )
    assert decision.actions == (CountRestart(), ReleaseDevices(), Reschedule())


def test_a_failure_with_restarts_left_and_no_checkpoint_starts_again() -> None:
    decision = decide(failed_job(2, 1), Exited(3, None, RANK_EXITED), 0)
    assert ended(decision) == (
        JobState.PENDING,
        f"{RANK_EXITED}; no checkpoint: restarting from the beginning (restart 2 of 2)",
    )
    assert decision.actions == (CountRestart(), ReleaseDevices(), Reschedule())


def test_a_failure_with_restarts_used_up_fails_saying_so() -> None:
    decision = decide(failed_job(2, 2, checkpoint=3), KILLED, 0)
    assert ended(decision) == (JobState.FAILED, f"{RANK_KILLED}; restarts used: 2 of 2")
    assert CountRestart() not in decision.actions


def test_without_restarts_a_failure_fails_as_it_always_did() -> None:
    assert ended(decide(failed_job(0, checkpoint=3), KILLED, 0)) == (JobState.FAILED, RANK_KILLED)


@pytest.mark.parametrize(
    ("job", "stimulus", "state"),
    [
        (failed_job(2, checkpoint=3), Exited(0, None), JobState.COMPLETED),
        (failed_job(2, checkpoint=3, cancel=True), KILLED, JobState.CANCELLED),
        (failed_job(2), ProcessesLost("gone"), JobState.FAILED),
    ],
)
def test_success_cancellation_and_lost_processes_are_no_restarts(
    job: JobFacts, stimulus: Exited | ProcessesLost, state: JobState
) -> None:
    decision = decide(job, stimulus, 0)
    assert ended(decision)[0] is state
    assert CountRestart() not in decision.actions


def test_a_job_that_fails_during_a_move_between_nodes_is_left_to_the_hand_off() -> None:
    job = JobFacts(1, JobState.MIGRATING, has_checkpoint=True, max_restarts=1, last_checkpoint=3)
    assert ended(decide(job, KILLED, 0)) == (JobState.FAILED, RANK_KILLED)


def test_a_restart_whose_checkpoint_number_is_unknown_names_the_last_one() -> None:
    job = JobFacts(1, JobState.RUNNING, has_checkpoint=True, max_restarts=1)
    assert ended(decide(job, KILLED, 0))[1].endswith("restoring from its last checkpoint (restart 1 of 1)")


def test_a_database_from_before_restarts_gets_them_with_none_allowed(tmp_path: Path) -> None:
    """An existing state database is brought up to date on open; its jobs keep failing as before."""
    path = tmp_path / "state.db"
    Store(path).close()
    with sqlite3.connect(path) as db:
        db.execute("ALTER TABLE jobs DROP COLUMN max_restarts")
        db.execute("ALTER TABLE jobs DROP COLUMN restarts_used")
        db.execute("ALTER TABLE jobs DROP COLUMN min_gpus")
        db.execute("ALTER TABLE jobs DROP COLUMN max_gpus")
        db.execute(
            "INSERT INTO jobs (id, name, uid, gid, user, priority, gpus, ranks, command, env, cwd, state,"
            " reason, submitted_at) VALUES (5, 'old', 0, 0, 'root', 0, 1, 1, '[\"true\"]', '{}', '/',"
            " 'PENDING', 'queued', 0)"
        )
    store = Store(path)
    try:
        job = store.get(5)
        assert job is not None
        assert (job.spec.max_restarts, job.restarts_used) == (0, 0)
        assert (job.spec.min_gpus, job.spec.max_gpus, job.spec.elastic) == (0, 0, False)
        store.count_restart(5)
        counted = store.get(5)
        assert counted is not None and counted.restarts_used == 1
    finally:
        store.close()


# Through the real daemon, with real processes


def test_max_restarts_outside_0_to_100_is_refused(daemon: Daemon) -> None:
    for bad in ("101", "-1"):
        result = daemon.sing("submit", "--max-restarts", bad, "--", "true")
        assert result.code != 0
        assert result.err.strip() == f"sing: --max-restarts must be between 0 and 100, not {bad}"
    assert daemon.sing("ps", "-a", "-o", "json").json() == []


def two_ranks_where_rank_1_fails(daemon: Daemon, max_restarts: int) -> int:
    """Submit 2 ranks: rank 1 prints a line and exits with 3, rank 0 waits to be stopped."""
    program = (
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    print('rank 1 runs', flush=True)\n"
        "    sys.exit(3)\n"
        "time.sleep(600)\n"
    )
    options = ["--ranks", "2", "--max-restarts", str(max_restarts)]
    return daemon.submit(PYTHON, "-c", program, options=options)


def test_without_restarts_a_dead_rank_fails_the_job(daemon: Daemon) -> None:
    job = two_ranks_where_rank_1_fails(daemon, 0)
    assert daemon.sing("wait", str(job), timeout=120).code == 3
    shown = daemon.job(job)
    assert (shown["state"], shown["reason"]) == ("FAILED", RANK_EXITED)
    assert (shown["max_restarts"], shown["restarts_used"]) == (0, 0)


def test_restarts_from_the_beginning_until_used_up(daemon: Daemon) -> None:
    """Without a checkpoint each restart starts the command again, on emptied logs; the last
    failure fails the job with the count."""
    job = two_ranks_where_rank_1_fails(daemon, 2)
    assert daemon.sing("wait", str(job), timeout=120).code == 3
    shown = daemon.job(job)
    assert (shown["state"], shown["reason"]) == ("FAILED", f"{RANK_EXITED}; restarts used: 2 of 2")
    assert (shown["max_restarts"], shown["restarts_used"], shown["attempt"]) == (2, 2, 3)
    reasons = [event["reason"] for event in shown["events"]]
    for restart in (1, 2):
        assert (
            f"{RANK_EXITED}; no checkpoint: restarting from the beginning (restart {restart} of 2)" in reasons
        )
    assert daemon.sing("logs", "--rank", "1", str(job)).out == "rank 1 runs\n"
    assert "Restarts:   2/2" in daemon.sing("show", str(job)).out


@pytest.mark.timeout(900)
def test_a_killed_rank_is_restored_from_the_last_checkpoint_exactly(daemon: Daemon) -> None:
    """2-rank DDP: checkpointed while rank 1 waits at step 10, then rank 1 is killed; the job is
    restored from that checkpoint and every rank prints what an uninterrupted run prints."""
    args = ["--steps", "20", "--hook", "allreduce"]
    expected = run_job(daemon, "ddp_train.py", args, ranks=2, gpus=2)
    workdir = Path(tempfile.mkdtemp(prefix="die-once-", dir=daemon.root))
    options = ["--env", "OMP_NUM_THREADS=1", "--cwd", str(workdir), "--ranks", "2", "--gpus", "2"]
    job = daemon.submit(
        PYTHON, str(PROGRAMS / "ddp_train.py"), *args, "--die-once", "1:10",
        options=[*options, "--max-restarts", "1"],
    )  # fmt: skip
    try:
        wait_until((workdir / "die-once.waiting").exists, timeout=300)
        taken = daemon.sing("checkpoint", str(job), timeout=300)
        assert taken.code == 0, taken.err
        seq = daemon.job(job)["last_checkpoint"]["seq"]
    except BaseException:
        daemon.sing("cancel", str(job))  # rank 1 would wait for die-once.go forever
        raise
    (workdir / "die-once.go").touch()
    succeeded(daemon, job, 2, timeout=600)
    assert (workdir / "die-once.died").exists()
    assert printed(rank_logs(daemon, job, 2)) == expected
    shown = daemon.job(job)
    reasons = [event["reason"] for event in shown["events"]]
    assert f"{RANK_KILLED}; restoring from checkpoint {seq} (restart 1 of 1)" in reasons
    assert any(reason.startswith(f"restored from checkpoint {seq}") for reason in reasons)
    assert (shown["state"], shown["restarts_used"]) == ("COMPLETED", 1)
