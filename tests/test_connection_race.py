"""A process of the job connects to a device while the job is being checkpointed.

The daemon finds a job's device connections before CRIU dumps it, to name them to CRIU as external;
a connection opened in between (a process's first use of a device, seen with Hugging Face's Trainer
checkpointed early) makes CRIU refuse the dump. Here a real daemon holds a real checkpoint at that
exact step (the fault point connections-found) while the job first touches its second device: the
checkpoint is taken again and succeeds, and the job, then preempted and restored with both of its
connections, prints what an undisturbed run prints.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from singularityd import faults
from tests.conftest import requires_root
from tests.helpers import Daemon, running_daemon, wait_until
from tests.proxy.conftest import PYTHON
from tests.test_collectives import JOB_OPTIONS, printed

LINES = ("step ", "final ")
JOINED = "joined cuda:1 sum 240.0\n"


def submit_late_device(daemon: Daemon, join: Path, release: Path) -> int:
    """The program that touches cuda:1 once `join` exists, on the job's 2 devices."""
    command = [PYTHON, "late_device.py", "--join", str(join), "--hold", str(release)]
    return daemon.submit(*command, options=[*JOB_OPTIONS, "--gpus", "2"])


def output(daemon: Daemon, job: int) -> str:
    """What the job has printed so far."""
    return daemon.sing("logs", str(job)).out


@requires_root
def test_a_device_connection_opened_during_a_checkpoint_makes_it_be_taken_again(
    daemon_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hold = daemon_root / "hold-connections-found"
    monkeypatch.setenv(faults.ENV, faults.CONNECTIONS_FOUND)
    monkeypatch.setenv(faults.HOLD_ENV, str(hold))
    with running_daemon(daemon_root, virtual_devices=2) as daemon:
        join, release = daemon_root / "join", daemon_root / "release"
        job = submit_late_device(daemon, join, release)
        try:
            wait_until(lambda: output(daemon, job).count("step ") >= 3, timeout=120)
            with ThreadPoolExecutor(1) as pool:
                checkpoint = pool.submit(daemon.sing, "checkpoint", str(job), timeout=180)
                wait_until(Path(f"{hold}.reached").exists, timeout=60)
                join.touch()
                wait_until(lambda: "joined cuda:1" in output(daemon, job), timeout=60)
                hold.touch()
                taken = checkpoint.result(timeout=200)
            assert taken.code == 0, taken.err
            logs = daemon.state_dir / "checkpoints" / str(job) / "logs"
            assert len(list(logs.glob("dump-*-failed-*.log"))) == 1, "refused once, then taken"
            assert daemon.sing("preempt", str(job), timeout=180).code == 0
            wait_until(lambda: daemon.job(job)["state"] == "RUNNING", timeout=120)
            release.touch()
            assert daemon.sing("wait", str(job), timeout=300).code == 0, output(daemon, job)
        except BaseException:
            daemon.sing("cancel", str(job))
            raise
        reasons = [event["reason"] for event in daemon.job(job)["events"]]
        assert any(reason.startswith("restored from checkpoint 2") for reason in reasons), reasons
        interrupted = printed([output(daemon, job)], LINES)
        assert output(daemon, job).count(JOINED) == 1

        undisturbed = submit_late_device(daemon, join, release)  # joins at its first step
        assert daemon.sing("wait", str(undisturbed), timeout=300).code == 0
        expected = printed([output(daemon, undisturbed)], LINES)
        assert output(daemon, undisturbed).count(JOINED) == 1
    assert interrupted == expected
    assert expected[0].count("step ") == 60 and "final " in expected[0]
