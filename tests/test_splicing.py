"""Replica splicing and resize through the real daemon: a job's ranks share devices, and a running
job moves between device counts, without its processes noticing.

The proof is bitwise: a 4-rank DDP run prints exactly the same losses and final weight checksums,
every rank, on 4 devices, on 1 device, resized 4 -> 2 -> 1 -> 3 -> 4 while it trains, and on 2
devices preempted and resumed 5 times. Jobs wait for a file the test creates before they end, so
every resize hits a running job.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.conftest import requires_root
from tests.helpers import Daemon, running_daemon, steps_done, wait_until
from tests.proxy.conftest import PYTHON
from tests.test_collectives import JOB_OPTIONS, printed, rank_logs, run_job, succeeded

RANKS = 4
STEPS = 60
ARGS = ["--steps", str(STEPS), "--hook", "allreduce"]


def submit_held(daemon: Daemon, gpus: int, release: Path, args: Sequence[str] = ARGS) -> int:
    """Submit the 4-rank DDP program on `gpus` devices, waiting for `release` before it ends."""
    options = [*JOB_OPTIONS, "--ranks", str(RANKS), "--gpus", str(gpus)]
    job = daemon.submit(PYTHON, "ddp_train.py", *args, "--hold", str(release), options=options)
    daemon.wait_state(job, "RUNNING")
    return job


def finish(daemon: Daemon, job: int, release: Path) -> list[str]:
    """Let the job end; each rank's printed lines."""
    release.touch()
    return printed(succeeded(daemon, job, RANKS, timeout=600))


def devices_of(daemon: Daemon, job: int) -> list[int]:
    """The devices the job holds now."""
    return list(daemon.job(job)["devices"])


@requires_root
@pytest.mark.timeout(1800)
def test_ddp_spliced_and_resized_is_exact(daemon_root: Path) -> None:
    """(a) 4 devices, (b) 1 device, (c) resized 4 -> 2 -> 1 -> 3 -> 4 while training,
    (d) 2 devices preempted and resumed 5 times: every rank prints the same bytes."""
    with running_daemon(daemon_root, virtual_devices=RANKS) as daemon:
        on_four = run_job(daemon, "ddp_train.py", ARGS, ranks=RANKS, gpus=RANKS)
        assert len(on_four) == RANKS and all(f"step {STEPS - 1} " in text for text in on_four)
        assert run_job(daemon, "ddp_train.py", ARGS, ranks=RANKS, gpus=1) == on_four

        release = daemon_root / "release-resize"
        job = submit_held(daemon, RANKS, release)
        try:
            for gpus in (2, 1, 3, 4):
                seen = steps_done(daemon, job, RANKS)
                wait_until(functools.partial(steps_beyond, daemon, job, min(seen, STEPS - 1)), timeout=300)
                result = daemon.sing("resize", str(job), "--gpus", str(gpus), timeout=300)
                assert result.code == 0, result.err
                assert len(devices_of(daemon, job)) == gpus
        except BaseException:
            daemon.sing("cancel", str(job))
            raise
        assert finish(daemon, job, release) == on_four
        reasons = [e["reason"] for e in daemon.job(job)["events"]]
        assert sum(r.startswith("resized to") for r in reasons) == 4

        release = daemon_root / "release-preempt"
        job = submit_held(daemon, 2, release)
        try:
            for _ in range(5):
                seen = steps_done(daemon, job, RANKS)
                wait_until(functools.partial(steps_beyond, daemon, job, min(seen, STEPS - 1)), timeout=300)
                result = daemon.sing("preempt", str(job), timeout=300)
                assert result.code == 0, result.err
                daemon.wait_state(job, "RUNNING", timeout=300)
                assert len(devices_of(daemon, job)) == 2
        except BaseException:
            daemon.sing("cancel", str(job))
            raise
        assert finish(daemon, job, release) == on_four


def steps_beyond(daemon: Daemon, job: int, beyond: int) -> bool:
    """Whether every rank of the job printed more than `beyond` steps."""
    return steps_done(daemon, job, RANKS) > beyond


def refused(result: object, code: int, words: str) -> None:
    """A clear one-line refusal: the exit code, the words, no traceback."""
    out = getattr(result, "err", "")
    assert getattr(result, "code", None) == code, out
    assert words in out and "Traceback" not in out and len(out.strip().splitlines()) == 1, out


def test_bad_splicing_and_resize_requests_are_refused(daemon: Daemon) -> None:
    """More devices than ranks, a resize out of range, of a job not running, of a single-rank job
    or of an unknown id: each a one-line refusal with a non-zero exit, nothing changed."""
    refused(
        daemon.sing("submit", "--ranks", "2", "--gpus", "3", "--", "true"),
        2,
        "--gpus 3 is more than --ranks 2",
    )
    refused(daemon.sing("resize", "999", "--gpus", "1"), 4, "999")
    done = daemon.submit("true", options=["--ranks", "2", "--gpus", "1"])
    assert daemon.sing("wait", str(done)).code == 0
    refused(daemon.sing("resize", str(done), "--gpus", "2"), 6, "only a RUNNING job can be resized")
    refused(daemon.sing("resize", str(done), "--gpus", "3"), 2, "between 1 and the job's 2 ranks")
    refused(daemon.sing("resize", str(done), "--gpus", "0"), 2, "between 1 and the job's 2 ranks")
    single = daemon.submit("true")
    refused(daemon.sing("resize", str(single), "--gpus", "1"), 2, "has one rank")
    assert daemon.job(done)["gpus"] == 1


def test_a_resize_beyond_the_free_devices_is_refused_without_stopping_the_job(daemon: Daemon) -> None:
    """A running 2-rank job on 1 device, the other 3 devices busy: growing it to 2 is refused at
    once, saying why (elastic: that it grows by itself), and the job runs on, not checkpointed."""
    fixed = daemon.submit("sleep", "600", options=["--ranks", "2", "--gpus", "1"])
    others = [daemon.submit("sleep", "600", options=["--gpus", "1"]) for _ in range(2)]
    elastic = daemon.submit("sleep", "600", options=["--ranks", "2", "--min-gpus", "1", "--max-gpus", "2"])
    try:
        for job in (fixed, *others, elastic):
            daemon.wait_state(job, "RUNNING", timeout=60)
        held = devices_of(daemon, elastic)
        refused(
            daemon.sing("resize", str(elastic), "--gpus", "2"),
            6,
            f"job {elastic} cannot grow to 2 devices now: it runs on 1 and 0 more are free; being elastic",
        )
        refused(
            daemon.sing("resize", str(fixed), "--gpus", "2"),
            6,
            f"job {fixed} cannot grow to 2 devices now: it runs on 1 and 0 more are free",
        )
        assert daemon.job(elastic)["state"] == "RUNNING" and devices_of(daemon, elastic) == held
        events = [e["reason"] for job in (elastic, fixed) for e in daemon.job(job)["events"]]
        assert not any("resize" in reason for reason in events), events
    finally:
        daemon.sing("cancel", *map(str, (elastic, fixed, *others)))


SEES_DEVICES = """
import os, torch
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
mine = torch.ones(2, device="cuda") * rank
other = torch.ones(2, device=f"cuda:{(rank + 2) % 4}")
print(torch.cuda.device_count(), mine.device, float(mine.sum()), other.device, float(other.sum()), flush=True)
"""


def test_spliced_ranks_see_every_device(daemon: Daemon) -> None:
    """4 ranks on 2 devices: each sees 4 devices, sets its own, and reaches another block's cuda:j."""
    job = daemon.submit(PYTHON, "-c", SEES_DEVICES, options=["--ranks", "4", "--gpus", "2"])
    succeeded(daemon, job, RANKS, timeout=300)
    lines = printed(rank_logs(daemon, job, RANKS), keep="4 ")
    assert lines == [f"4 cuda:{r} {2.0 * r} cuda:{(r + 2) % 4} 2.0\n" for r in range(RANKS)]
    assert "4 ranks share them" in daemon.sing("show", str(job)).out


TWO_DEVICE_STEPS = 12
TWO_DEVICE_ARGS = ["--steps", str(TWO_DEVICE_STEPS), "--sleep", "0.05"]


@requires_root
@pytest.mark.timeout(1200)
def test_ranks_using_two_devices_served_by_one_survive_restores(daemon_root: Path) -> None:
    """2 ranks each training a model split over cuda:0 and cuda:1: on 1 device (both of a rank's
    devices served by one proxy), and resized 2 -> 1, preempted and resumed there, and resized back
    to 2, they print exactly what they print on 2 devices uninterrupted."""
    ranks = 2
    with running_daemon(daemon_root, virtual_devices=2) as daemon:
        expected = run_job(daemon, "two_devices.py", TWO_DEVICE_ARGS, ranks=ranks, gpus=2)
        for rank, text in enumerate(expected):
            assert text.startswith(f"rank {rank} sees 2 devices\n"), expected
            assert f"rank {rank} step {TWO_DEVICE_STEPS - 1} " in text and f"rank {rank} final " in text
        assert run_job(daemon, "two_devices.py", TWO_DEVICE_ARGS, ranks=ranks, gpus=1) == expected

        release = daemon_root / "release-two-devices"
        options = [*JOB_OPTIONS, "--ranks", str(ranks), "--gpus", "2"]
        job = daemon.submit(
            PYTHON, "two_devices.py", *TWO_DEVICE_ARGS, "--hold", str(release), options=options
        )
        daemon.wait_state(job, "RUNNING")
        try:
            for command, devices in (
                (("resize", "--gpus", "1"), 1),
                (("preempt",), 1),
                (("resize", "--gpus", "2"), 2),
            ):
                beyond = min(steps_done(daemon, job, ranks), TWO_DEVICE_STEPS - 1)
                wait_until(functools.partial(ranks_beyond, daemon, job, ranks, beyond), timeout=300)
                result = daemon.sing(command[0], str(job), *command[1:], timeout=300)
                assert result.code == 0, result.err
                daemon.wait_state(job, "RUNNING", timeout=300)
                assert len(devices_of(daemon, job)) == devices
        except BaseException:
            daemon.sing("cancel", str(job))
            raise
        release.touch()
        assert printed(succeeded(daemon, job, ranks, timeout=600)) == expected
        reasons = [e["reason"] for e in daemon.job(job)["events"]]
        assert sum(r.startswith("resized to") for r in reasons) == 2, reasons
        assert any(r.startswith("preempted by") for r in reasons), reasons


def ranks_beyond(daemon: Daemon, job: int, ranks: int, beyond: int) -> bool:
    """Whether every one of the job's `ranks` printed more than `beyond` steps."""
    return steps_done(daemon, job, ranks) > beyond


def rank_processes(daemon: Daemon, job: int) -> list[str]:
    """The PIDs of the job's rank processes alive now (its supervisor's children)."""
    supervisor = daemon.supervisor_pid(job)
    return Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()


@requires_root
@pytest.mark.timeout(900)
def test_a_rank_that_ended_with_work_left_moves_with_the_job(daemon_root: Path) -> None:
    """nanoGPT's pattern: only rank 0 reads values, so rank 1 queues all its steps and its process
    ends while its session still has them to run, waiting in collectives for rank 0. The job, rank
    0 held at a gate, is then resized 2 -> 1, preempted, and resized 1 -> 2: rank 1's session moves
    with the job and runs its work, and rank 0 prints exactly what it prints uninterrupted."""
    args = ["--steps", "40", "--rank0-reads"]
    with running_daemon(daemon_root, virtual_devices=2) as daemon:
        expected = run_job(daemon, "ddp_train.py", args, ranks=2, gpus=2)
        assert expected[1] == "" and "rank 0 final " in expected[0], expected
        gate = daemon_root / "gate"
        options = [*JOB_OPTIONS, "--ranks", "2", "--gpus", "2"]
        job = daemon.submit(PYTHON, "ddp_train.py", *args, "--gate", f"10:{gate}", options=options)
        try:
            daemon.wait_state(job, "RUNNING")
            wait_until(
                lambda: steps_done(daemon, job, 1) == 10 and len(rank_processes(daemon, job)) == 1,
                timeout=120,
            )
            for command in (("resize", "--gpus", "1"), ("preempt",), ("resize", "--gpus", "2")):
                result = daemon.sing(command[0], str(job), *command[1:], timeout=300)
                assert result.code == 0, result.err
                daemon.wait_state(job, "RUNNING", timeout=300)
            gate.touch()
            daemon.wait_ok(job, timeout=300)
        except BaseException:
            daemon.sing("cancel", str(job))
            raise
        assert printed(rank_logs(daemon, job, 2)) == expected
