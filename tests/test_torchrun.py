"""A job that runs torchrun itself: the launcher and its workers run inside the job, on its devices.

torchrun's rendezvous builds a libuv TCPStore whatever USE_LIBUV says, and libuv holds an io_uring
that CRIU cannot dump; the in-job bootstrap makes USE_LIBUV=0 (the daemon's default) hold there too
(proxy/bootstrap/_singularity_proxy/stores.py). The proof is bitwise: preempted and resumed twice,
each worker prints what it prints when the job runs uninterrupted.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import requires_root
from tests.helpers import Daemon, running_daemon, wait_until
from tests.proxy.conftest import PYTHON
from tests.test_collectives import JOB_OPTIONS

TORCHRUN = str(Path(PYTHON).parent / "torchrun")
WORKERS = 2
STEPS = 40
ARGS = ["--steps", str(STEPS), "--hook", "allreduce", "--sleep", "0.05"]


def submit_torchrun(daemon: Daemon, *args: str) -> int:
    """Submit ddp_train.py launched by torchrun (one job process, WORKERS workers) on WORKERS devices."""
    command = [TORCHRUN, "--standalone", "--nproc-per-node", str(WORKERS), "ddp_train.py", *args]
    return daemon.submit(*command, options=[*JOB_OPTIONS, "--gpus", str(WORKERS)])


def job_log(daemon: Daemon, job: int) -> str:
    """What the job (torchrun and its workers) printed so far."""
    log = daemon.state_dir / "jobs" / str(job) / "logs" / "rank-0.log"
    return log.read_text() if log.exists() else ""


PRINTED = re.compile(r"rank (\d+) (step \d+ loss -?\d+\.\d{10}|final [0-9a-f]+)")
"""What a worker of ddp_train.py prints. Two workers share the job's output, and a worker's text
and its newline can go out as two writes, so a line may hold the ends of two: found by pattern."""


def worker_lines(log: str) -> list[str]:
    """Each worker's printed lines, in the order it printed them."""
    found = PRINTED.findall(log)
    return ["".join(f"{text}\n" for rank, text in found if int(rank) == worker) for worker in range(WORKERS)]


def fewest_steps(daemon: Daemon, job: int) -> int:
    """The fewest steps a worker of the job has printed."""
    return min(text.count("step ") for text in worker_lines(job_log(daemon, job)))


@requires_root
@pytest.mark.timeout(900)
def test_a_torchrun_job_is_preempted_and_resumed_exactly(daemon_root: Path) -> None:
    """torchrun with 2 DDP workers as the job's command: preempted twice while it trains, resumed
    each time, every worker prints the same losses and final checksum as an uninterrupted run."""
    release = daemon_root / "release"
    with running_daemon(daemon_root, virtual_devices=WORKERS) as daemon:
        plain = submit_torchrun(daemon, *ARGS)
        assert daemon.sing("wait", str(plain), timeout=600).code == 0, job_log(daemon, plain)
        expected = worker_lines(job_log(daemon, plain))
        assert all("final " in expected[rank] for rank in range(WORKERS)), expected

        job = submit_torchrun(daemon, *ARGS, "--hold", str(release))
        daemon.wait_state(job, "RUNNING")
        try:
            for beyond in (3, 3 + STEPS // 4):
                wait_until(lambda: fewest_steps(daemon, job) > beyond, timeout=300)  # noqa: B023
                result = daemon.sing("preempt", str(job), timeout=300)
                assert result.code == 0, result.err
                daemon.wait_state(job, "RUNNING", timeout=300)
        except BaseException:
            daemon.sing("cancel", str(job))
            raise
        release.touch()
        assert daemon.sing("wait", str(job), timeout=600).code == 0, job_log(daemon, job)
        assert worker_lines(job_log(daemon, job)) == expected
        reasons = [e["reason"] for e in daemon.job(job)["events"]]
        assert sum(r.startswith("restored from checkpoint") for r in reasons) == 2, reasons
