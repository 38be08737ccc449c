"""A daemon killed after a stopping dump's manifest is durable, before the job's new state is stored.

The pure decision (core.lost_processes) is tested on its own; then a real daemon is killed at that
exact step (the fault point stopped-dump-recorded) while it preempts or suspends a real training
job, or resizes a real 2-rank DDP job, with real CRIU. Restarted, it finds the job RUNNING with no
processes and a complete checkpoint taken to stop it: the job must become what the stop was for
(queued and resumed, held until resumed, or restored on the new number of devices), and its
output must equal an uninterrupted run's byte for byte.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from singularityd import faults
from singularityd.core.actions import TakeCheckpoint
from singularityd.core.lost_processes import (
    MissedStop,
    NewestCheckpoint,
    StopKind,
    StopPurpose,
    after_lost_processes,
)
from singularityd.core.stimuli import Checkpointed, ProcessesLost
from tests.conftest import requires_root
from tests.helpers import Daemon, running_daemon, wait_until
from tests.helpers import steps_done as steps_of_ranks
from tests.proxy.conftest import PYTHON, direct_ranks
from tests.test_collectives import JOB_OPTIONS, printed, succeeded
from tests.test_preempt import (
    events,
    release_file,
    steps_done,
    submit_training,
    uninterrupted_output,
    wait_progress,
)

LOST = "the job's processes ended while the daemon was down, without an exit status"
RECORDED = "(complete on disk when the daemon stopped, before it recorded the job stopped"
RUN_BEGAN = 1000.0


def checkpoint(purpose: StopPurpose | None, created_at: float = RUN_BEGAN + 5.0) -> NewestCheckpoint:
    """A newest complete checkpoint, number 7, taken `created_at`."""
    return NewestCheckpoint(7, created_at, purpose)


@pytest.mark.parametrize(
    ("take", "kind"),
    [
        (TakeCheckpoint(True, reason="preempted by root"), StopKind.PREEMPT),
        (
            TakeCheckpoint(True, reason="preempted for job 2, which outranks it", for_scheduler=True),
            StopKind.PREEMPT,
        ),
        (TakeCheckpoint(True, True, "suspended by root"), StopKind.SUSPEND),
        (TakeCheckpoint(True, reason="resized to 2 devices by root", gpus=2), StopKind.RESIZE),
        (TakeCheckpoint(True, reason="stopped to move to node-b", for_move=True), StopKind.MOVE),
    ],
)
def test_a_stop_purpose_survives_its_manifest_and_gives_back_the_checkpoint(
    take: TakeCheckpoint, kind: StopKind
) -> None:
    purpose = StopPurpose.of(take)
    assert purpose is not None and purpose.kind is kind
    read = StopPurpose.from_dict(purpose.as_dict())
    assert read == purpose
    assert read.take() == take


def test_checkpoints_in_place_and_unknown_purposes_have_none() -> None:
    assert StopPurpose.of(TakeCheckpoint(False, reason="periodic checkpoint", periodic=True)) is None
    assert StopPurpose.from_dict(None) is None
    assert StopPurpose.from_dict({"kind": "teleport"}) is None
    assert StopPurpose.from_dict("preempt") is None


@pytest.mark.parametrize(
    ("purpose", "gpus"),
    [
        (StopPurpose(StopKind.PREEMPT, "preempted by root"), 0),
        (StopPurpose(StopKind.SUSPEND, "suspended by root"), 0),
        (StopPurpose(StopKind.RESIZE, "resized to 3 devices by root", 3), 3),
    ],
)
def test_a_stop_completed_in_the_current_run_is_replayed(purpose: StopPurpose, gpus: int) -> None:
    outcome = after_lost_processes(checkpoint(purpose), RUN_BEGAN, LOST)
    assert isinstance(outcome, MissedStop)
    assert outcome.take == purpose.take() and outcome.gpus == gpus
    assert isinstance(outcome.outcome, Checkpointed)
    assert outcome.outcome.summary.startswith("checkpoint 7 (complete on disk when the daemon stopped")


@pytest.mark.parametrize(
    "newest",
    [
        None,
        checkpoint(None),
        checkpoint(StopPurpose(StopKind.MOVE, "stopped to move to node-b")),
        checkpoint(StopPurpose(StopKind.PREEMPT, "preempted by root"), created_at=RUN_BEGAN - 1.0),
    ],
    ids=["no-checkpoint", "in-place", "move", "before-this-run"],
)
def test_anything_else_is_lost_processes(newest: NewestCheckpoint | None) -> None:
    assert after_lost_processes(newest, RUN_BEGAN, LOST) == ProcessesLost(LOST)


def test_a_job_that_never_ran_here_or_was_being_cancelled_is_lost_processes() -> None:
    purpose = StopPurpose(StopKind.PREEMPT, "preempted by root")
    assert after_lost_processes(checkpoint(purpose), None, LOST) == ProcessesLost(LOST)
    assert after_lost_processes(checkpoint(purpose), RUN_BEGAN, LOST, cancel_requested=True) == ProcessesLost(
        LOST
    )


@contextlib.contextmanager
def dying_at_the_fault_point(daemon_root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Daemon]:
    """A daemon with 2 devices that kills itself at stopped-dump-recorded (its restarts do not)."""
    monkeypatch.setenv(faults.ENV, faults.STOPPED_DUMP_RECORDED)
    with running_daemon(daemon_root, virtual_devices=2, config={"checkpoint_keep": 3}) as daemon:
        monkeypatch.delenv(faults.ENV)
        yield daemon


def killed_at_the_fault_point(daemon: Daemon) -> None:
    """Wait until the daemon has killed itself at the fault point; start it again."""
    assert daemon.process is not None
    assert daemon.process.wait(120) == -signal.SIGKILL, "the daemon must die at the fault point"
    daemon.process = None
    daemon.start()


@pytest.fixture
def dying_daemon(daemon_root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Daemon]:
    """A daemon with working checkpoints that kills itself at stopped-dump-recorded."""
    with dying_at_the_fault_point(daemon_root, monkeypatch) as daemon:
        info = daemon.sing("doctor")
        if "checkpoints unavailable" in info.out:
            pytest.fail(f"CRIU must work for these tests (run scripts/setup):\n{info.out}")
        yield daemon


@requires_root
@pytest.mark.slow
@pytest.mark.parametrize("verb", ["preempt", "suspend"])
def test_a_daemon_killed_before_it_stored_a_stop_settles_the_job_as_the_stop_asked(
    dying_daemon: Daemon, verb: str
) -> None:
    daemon = dying_daemon
    release = release_file(daemon)
    job = submit_training(daemon, steps=120, hold=release)
    daemon.wait_state(job, "RUNNING")
    wait_progress(daemon, job, 10, steps=120)
    asked = daemon.sing(verb, str(job), timeout=120)
    stopped_at = steps_done(daemon, job)
    killed_at_the_fault_point(daemon)
    assert asked.code != 0
    reasons = [str(e["reason"]) for e in events(daemon, job)]
    if verb == "suspend":
        held = daemon.wait_state(job, "SUSPENDED")
        assert held["devices"] == [] and held["reason"].startswith("suspended by root: checkpoint ")
        assert RECORDED in held["reason"] and held["reason"].endswith("held until resumed"), reasons
        assert steps_done(daemon, job) == stopped_at
        resumed = daemon.sing("resume", str(job))
        assert resumed.code == 0, resumed.err
    else:
        assert any(r.startswith("preempted by root: checkpoint ") and RECORDED in r for r in reasons), reasons
    daemon.wait_state(job, "RUNNING", timeout=120)
    assert not any("without an exit status" in r for r in reasons), reasons
    release.touch()
    assert daemon.sing("wait", str(job), timeout=300).code == 0
    assert daemon.sing("logs", str(job)).out == uninterrupted_output(120)
    assert any(str(e["reason"]).startswith("restored from checkpoint") for e in events(daemon, job))


@requires_root
@pytest.mark.slow
def test_a_daemon_killed_before_it_stored_a_resize_restores_the_job_on_the_new_size(
    daemon_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2-rank DDP job on 2 devices, resized to 1: the daemon dies once the resize's checkpoint is
    complete, and restarted restores the job on 1 device; every rank prints what it prints directly."""
    args = ["--steps", "30", "--hook", "allreduce"]
    expected = direct_ranks("ddp_train.py", [*args, "--device", "cpu"], 2)
    with dying_at_the_fault_point(daemon_root, monkeypatch) as daemon:
        release = daemon_root / "release-resize"
        options = [*JOB_OPTIONS, "--ranks", "2", "--gpus", "2"]
        job = daemon.submit(PYTHON, "ddp_train.py", *args, "--hold", str(release), options=options)
        daemon.wait_state(job, "RUNNING", timeout=120)
        wait_until(lambda: steps_of_ranks(daemon, job, 2) > 3, timeout=300)
        asked = daemon.sing("resize", str(job), "--gpus", "1", timeout=300)
        killed_at_the_fault_point(daemon)
        assert asked.code != 0
        reasons = [str(e["reason"]) for e in events(daemon, job)]
        assert any(
            r.startswith("resized to 1 device by root: checkpoint ") and RECORDED in r for r in reasons
        ), reasons
        shown = daemon.wait_state(job, "RUNNING", timeout=300)
        assert len(shown["devices"]) == 1 and shown["gpus"] == 1, shown
        release.touch()
        assert printed(succeeded(daemon, job, 2, timeout=600)) == expected


@requires_root
@pytest.mark.slow
def test_a_cancel_asked_while_a_preemption_checkpoints_ends_the_job_cancelled(
    daemon_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`sing cancel` while `sing preempt`'s checkpoint is being recorded: the job ends CANCELLED
    and is never resumed from that checkpoint."""
    hold = daemon_root / "hold-at-recorded"
    monkeypatch.setenv(faults.ENV, faults.STOPPED_DUMP_RECORDED)
    monkeypatch.setenv(faults.HOLD_ENV, str(hold))
    with running_daemon(daemon_root, virtual_devices=2) as daemon:
        monkeypatch.delenv(faults.ENV)
        monkeypatch.delenv(faults.HOLD_ENV)
        release = release_file(daemon)
        job = submit_training(daemon, steps=120, hold=release)
        daemon.wait_state(job, "RUNNING")
        wait_progress(daemon, job, 10, steps=120)
        with ThreadPoolExecutor(1) as pool:
            preempting = pool.submit(daemon.sing, "preempt", str(job), timeout=120)
            wait_until(Path(f"{hold}.reached").exists, timeout=120)
            cancelled = daemon.sing("cancel", str(job))
            assert cancelled.code == 0, cancelled.err
            hold.touch()
            preempted = preempting.result()
        ended = daemon.wait_state(job, "CANCELLED", timeout=60)
        assert "cancelled (asked while the checkpoint ran)" in ended["reason"]
        assert ended["devices"] == []
        release.touch()
        assert daemon.sing("wait", str(job), timeout=60).code != 0
        assert daemon.job(job)["state"] == "CANCELLED", preempted.out + preempted.err
        reasons = [str(e["reason"]) for e in events(daemon, job)]
        assert not any(r.startswith("restored from checkpoint") for r in reasons), reasons
