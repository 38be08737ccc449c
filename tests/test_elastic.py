"""Elastic jobs through the real daemon: a 4-rank DDP job with --min-gpus 1 --max-gpus 4 grows
into idle devices, shrinks when another job arrives and grows back when it leaves, and prints
exactly what it prints on 4 devices throughout.

No step depends on timing: the other jobs and the elastic job end, and the elastic job passes
its gates (steps 15, 30, 45), only when the test creates their files, and each change is awaited
from the daemon's own view (devices held, events).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import requires_root
from tests.helpers import Daemon, running_daemon, steps_done, wait_until
from tests.proxy.conftest import PYTHON
from tests.test_collectives import JOB_OPTIONS, run_job
from tests.test_splicing import ARGS, RANKS, STEPS, devices_of, finish, refused

ELASTIC = ["--ranks", str(RANKS), "--min-gpus", "1", "--max-gpus", str(RANKS)]
GATES = (15, 30, 45)
"""Steps before which the elastic job waits for the test: each size trains a known span of steps
(0-14 on 1 device, 15-29 on 4, 30-44 on 2, 45-59 on 4)."""


def hold_devices(daemon: Daemon, gpus: int, release: Path) -> int:
    """A job holding `gpus` devices until `release` exists, once it runs."""
    wait = f"while [ ! -e {release} ]; do sleep 0.2; done"
    job = daemon.submit("sh", "-c", wait, options=["--gpus", str(gpus), "--name", f"hold{gpus}"])
    daemon.wait_state(job, "RUNNING", timeout=120)
    return job


def on_devices(daemon: Daemon, job: int, gpus: int) -> None:
    """Wait until the job runs on `gpus` devices."""
    wait_until(
        lambda: daemon.job(job)["state"] == "RUNNING" and len(devices_of(daemon, job)) == gpus, timeout=300
    )


def at_gate(daemon: Daemon, job: int, step: int, ranks: int = RANKS) -> None:
    """Wait until every rank has printed `step` steps (it then waits at the gate before the next)."""
    wait_until(lambda: steps_done(daemon, job, ranks) >= step, timeout=300)


def resized_to(daemon: Daemon, job: int) -> list[int]:
    """The device counts the job was resized to, in order, from its events."""
    reasons = [event["reason"] for event in daemon.job(job)["events"]]
    return [int(reason.split()[2]) for reason in reasons if reason.startswith("resized to")]


@requires_root
@pytest.mark.timeout(1800)
def test_an_elastic_job_grows_shrinks_and_grows_back_exactly(daemon_root: Path) -> None:
    """Started on the 1 device left free, the job grows to 4 when the other job ends, shrinks to 2
    for a job of 2 devices and grows back to 4 when that one ends, training a span of steps on
    each size: every rank prints the same bytes as on 4 devices."""
    config = {"elastic_grow_seconds": 1.0}
    with running_daemon(daemon_root, virtual_devices=RANKS, config=config) as daemon:
        on_four = run_job(daemon, "ddp_train.py", ARGS, ranks=RANKS, gpus=RANKS)
        assert len(on_four) == RANKS and all(f"step {STEPS - 1} " in text for text in on_four)

        first = hold_devices(daemon, 3, daemon_root / "release-first")
        release = daemon_root / "release-elastic"
        gates = [arg for step in GATES for arg in ("--gate", f"{step}:{daemon_root / f'gate-{step}'}")]
        program = [PYTHON, "ddp_train.py", *ARGS, *gates, "--hold", str(release)]
        job = daemon.submit(*program, options=[*JOB_OPTIONS, *ELASTIC])
        try:
            on_devices(daemon, job, 1)
            at_gate(daemon, job, GATES[0])
            (daemon_root / "release-first").touch()
            assert daemon.sing("wait", str(first), timeout=120).code == 0
            on_devices(daemon, job, 4)
            (daemon_root / f"gate-{GATES[0]}").touch()
            at_gate(daemon, job, GATES[1])
            second = hold_devices(daemon, 2, daemon_root / "release-second")
            on_devices(daemon, job, 2)
            assert sorted(devices_of(daemon, second) + devices_of(daemon, job)) == [0, 1, 2, 3]
            (daemon_root / f"gate-{GATES[1]}").touch()
            at_gate(daemon, job, GATES[2])
            (daemon_root / "release-second").touch()
            assert daemon.sing("wait", str(second), timeout=120).code == 0
            on_devices(daemon, job, 4)
            (daemon_root / f"gate-{GATES[2]}").touch()
        except BaseException:
            daemon.sing("cancel", str(job))
            raise
        assert finish(daemon, job, release) == on_four
        assert resized_to(daemon, job) == [4, 2, 4]
        shown = daemon.sing("show", str(job)).out
        assert "Devices:    none held (ran on 4; elastic 1-4)" in shown, shown


def test_bad_elastic_requests_are_refused(daemon: Daemon) -> None:
    """An empty range, a maximum above the ranks, --gpus outside the range and a resize outside
    it: each a one-line refusal, nothing queued or changed; the range shows in ps and show."""
    options = ["--ranks", "4"]
    refused(
        daemon.sing("submit", *options, "--min-gpus", "3", "--max-gpus", "2", "--", "true"), 2, "--min-gpus 3"
    )
    refused(daemon.sing("submit", *options, "--max-gpus", "5", "--", "true"), 2, "--max-gpus 5 is more than")
    refused(
        daemon.sing("submit", *options, "--min-gpus", "2", "--max-gpus", "3", "--gpus", "4", "--", "true"),
        2,
        "outside the elastic range 2-3",
    )
    done = daemon.submit("true", options=[*options, "--min-gpus", "2", "--max-gpus", "3"])
    assert daemon.sing("wait", str(done)).code == 0
    refused(daemon.sing("resize", str(done), "--gpus", "1"), 2, f"outside job {done}'s elastic range 2-3")
    shown = daemon.job(done)
    assert (shown["gpus"], shown["min_gpus"], shown["max_gpus"]) == (3, 2, 3)
    assert (
        "Devices:    none held (ran on 3; elastic 2-3; 4 ranks share them)"
        in daemon.sing("show", str(done)).out
    )
    assert "3 (2-3)" in daemon.sing("ps", "-a").out


@requires_root
@pytest.mark.timeout(300)
def test_an_elastic_job_shrunk_by_hand_grows_back_into_the_devices_left_idle(daemon_root: Path) -> None:
    """A resize by hand moves an elastic job within its range; the scheduler goes on managing it,
    so devices that stay idle (nothing queued) are given back to it, as they are after a preemption
    that resumes it on fewer devices than are free."""
    with running_daemon(daemon_root, virtual_devices=2, config={"elastic_grow_seconds": 1.0}) as daemon:
        release = daemon_root / "release"
        wait = f"while [ ! -e {release} ]; do sleep 0.2; done"
        job = daemon.submit("sh", "-c", wait, options=["--ranks", "2", "--min-gpus", "1", "--max-gpus", "2"])
        try:
            on_devices(daemon, job, 2)
            assert daemon.sing("resize", str(job), "--gpus", "1").code == 0
            on_devices(daemon, job, 2)
        finally:
            release.touch()
        assert daemon.sing("wait", str(job), timeout=120).code == 0
        assert resized_to(daemon, job) == [1, 2]
