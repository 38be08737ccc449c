"""Multi-rank jobs on proxied devices, through the real daemon: collectives and a consistent cut.

The ranks' collectives on device tensors are carried out by the job's proxy servers. A 2-rank
DDP run must print exactly what the same program prints run directly on the CPU with gloo; a
4-rank run preempted and resumed at random moments exactly what an uninterrupted one prints;
a rank that dies fails the job with its reason, never a hang.
"""

from __future__ import annotations

import functools
import random
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import pytest

from tests.conftest import requires_root
from tests.helpers import Daemon, Result, preempt_while_training, running_daemon, wait_until
from tests.proxy.conftest import PROGRAMS, PYTHON, base_env, direct_ranks

JOB_OPTIONS = ["--env", "OMP_NUM_THREADS=1", "--env", "PYTHONFAULTHANDLER=1", "--cwd", str(PROGRAMS)]
"""Every rank single-threaded (bitwise equal to direct runs), with Python's stacks in its log should
it crash (a rank has been seen to abort at exit, rarely, after printing all it prints)."""


LOG_END_CHARS = 6000
"""How much of the end of each rank's log a failed job's test shows."""


class RunsSing(Protocol):
    """A daemon the tests reach with `sing` (a test's Daemon, or a lab's Node)."""

    def sing(self, *args: str, timeout: float = ..., user: str | None = ...) -> Result: ...


def rank_logs(daemon: RunsSing, job: int, ranks: int) -> list[str]:
    """What each rank of the job printed (stdout and stderr)."""
    return [daemon.sing("logs", "--rank", str(rank), str(job)).out for rank in range(ranks)]


def printed(logs: Sequence[str], keep: str | tuple[str, ...] = "rank ") -> list[str]:
    """Each rank's log less torch's warnings on stderr: only the lines that start with `keep`."""
    return ["".join(line for line in log.splitlines(keepends=True) if line.startswith(keep)) for log in logs]


def submit(daemon: Daemon, program: str, args: Sequence[str], ranks: int, gpus: int) -> int:
    """Submit the program as a job of `ranks` ranks on `gpus` devices."""
    return daemon.submit(
        PYTHON, program, *args, options=[*JOB_OPTIONS, "--ranks", str(ranks), "--gpus", str(gpus)]
    )


def succeeded(daemon: Daemon, job: int, ranks: int, timeout: float = 900) -> list[str]:
    """Wait for the job to succeed; each rank's log. A job that fails fails the test with what
    `sing show` says and the end of every rank's log (a crashed rank's stacks are there), in full:
    pytest would cut a long assertion message short."""
    result = daemon.sing("wait", str(job), timeout=timeout)
    logs = rank_logs(daemon, job, ranks)
    if result.code != 0:
        ends = [
            f"--- rank {rank}, the end of its log:\n{log[-LOG_END_CHARS:]}" for rank, log in enumerate(logs)
        ]
        shown = daemon.sing("show", str(job)).out
        pytest.fail("\n".join([f"job {job} ended with {result.code}", shown, *ends]))
    return logs


def run_job(daemon: Daemon, program: str, args: Sequence[str], ranks: int, gpus: int) -> list[str]:
    """Submit a job, wait for it to succeed, and return each rank's printed lines."""
    return printed(succeeded(daemon, submit(daemon, program, args, ranks, gpus), ranks))


def test_ddp_two_ranks_equal_direct_gloo(daemon: Daemon) -> None:
    """2 ranks on 2 devices, and 2 ranks sharing 1 device (comm hook, no_sync, unused parameters,
    gradients as bucket views) print exactly what the direct gloo run prints."""
    plain = ["--steps", "12"]
    options = [*plain, "--hook", "allreduce", "--accumulate", "2", "--unused", "--bucket-view"]
    assert run_job(daemon, "ddp_train.py", plain, ranks=2, gpus=2) == direct_ranks(
        "ddp_train.py", [*plain, "--device", "cpu"], 2
    )
    assert run_job(daemon, "ddp_train.py", options, ranks=2, gpus=1) == direct_ranks(
        "ddp_train.py", [*options, "--device", "cpu"], 2
    )


@requires_root
@pytest.mark.timeout(1200)
def test_ddp_four_ranks_preempted_five_times_is_exact(daemon_root: Path) -> None:
    """4 ranks on 4 devices, preempted and resumed 5 times at random moments (collectives in
    flight), print exactly what an uninterrupted run prints, every rank."""
    total, ranks = 600, 4
    args = ["--steps", str(total), "--hook", "allreduce"]
    with running_daemon(daemon_root, virtual_devices=ranks) as daemon:
        expected = run_job(daemon, "ddp_train.py", args, ranks=ranks, gpus=ranks)
        assert preempted_run(daemon, "ddp_train.py", args, ranks, total, 5, seed=10, spread=0.5) == expected


def preempted_run(
    daemon: Daemon,
    program: str,
    args: Sequence[str],
    ranks: int,
    total: int,
    times: int,
    *,
    seed: int,
    spread: float,
) -> list[str]:
    """What every rank of `program` prints when it runs on one device per rank and is preempted
    and resumed `times` times while it trains (at random moments, up to `spread` seconds after
    each resume; `seed` seeds them), then lets it finish."""
    rng = random.Random(seed)
    release = daemon.root / f"release-{program}"
    options = [*JOB_OPTIONS, "--ranks", str(ranks), "--gpus", str(ranks)]
    job = daemon.submit(PYTHON, program, *args, "--hold", str(release), options=options)
    daemon.wait_state(job, "RUNNING")
    preempt_while_training(
        daemon, job, ranks, total, times, wait_timeout=300,
        before=lambda: time.sleep(rng.uniform(0.0, spread)), still_training=True,
    )  # fmt: skip
    release.touch()
    succeeded(daemon, job, ranks, timeout=600)
    reasons = [e["reason"] for e in daemon.job(job)["events"]]
    assert sum(r.startswith("restored from checkpoint") for r in reasons) == times
    return printed(rank_logs(daemon, job, ranks))


def both_reached(daemon: Daemon, job: int) -> bool:
    """Whether both ranks of late_rank.py have printed that they reached the late step."""
    return all("reaches step" in log for log in rank_logs(daemon, job, 2))


@requires_root
@pytest.mark.timeout(900)
def test_a_job_preempted_while_a_rank_is_late_to_a_rooted_collective_is_exact(daemon_root: Path) -> None:
    """Rank 1 is late to a broadcast, scatter, gather or reduce whose other side needs nothing from
    it, and the job is preempted then: restored, the collective completes and both ranks print what
    an undisturbed run prints. (A server that had completed it for rank 0 alone would leave rank 1
    waiting forever for data that the checkpoint did not hold.)"""
    with running_daemon(daemon_root, virtual_devices=2) as daemon:
        for kind in ("broadcast", "scatter", "gather", "reduce"):
            expected = run_job(daemon, "late_rank.py", ["--kind", kind], ranks=2, gpus=2)
            late = daemon_root / f"late-{kind}"
            job = submit(daemon, "late_rank.py", ["--kind", kind, "--late-until", str(late)], ranks=2, gpus=2)
            wait_until(functools.partial(both_reached, daemon, job), timeout=300)
            time.sleep(0.5)  # rank 0 goes into the collective meanwhile
            assert daemon.sing("preempt", str(job)).code == 0
            daemon.wait_state(job, "RUNNING", timeout=300)
            late.touch()
            assert printed(succeeded(daemon, job, 2, timeout=120)) == expected, kind


def test_a_crashing_rank_fails_the_job(daemon: Daemon) -> None:
    """Rank 1 dies mid-training: the job fails with its exit code and reason, no rank hangs."""
    options = [*JOB_OPTIONS, "--ranks", "2", "--gpus", "2"]
    job = daemon.submit(PYTHON, "ddp_train.py", "--steps", "1000", "--crash", "1:3", options=options)
    assert daemon.sing("wait", str(job), timeout=300).code == 3
    shown = daemon.job(job)
    assert shown["state"] == "FAILED"
    assert shown["events"][-1]["reason"] == "rank 1 exited with code 3; the other ranks were stopped"
    assert "rank 1 crashes at step 3" in rank_logs(daemon, job, 2)[1]


def test_host_and_device_tensors_in_one_collective(daemon: Daemon) -> None:
    """Gathering a host tensor into device tensors fails with the error torch's NCCL gives."""
    options = [*JOB_OPTIONS, "--ranks", "2", "--gpus", "1"]
    job = daemon.submit(PYTHON, "raw_collectives.py", "--mix", options=options)
    assert daemon.sing("wait", str(job), timeout=300).code == 1
    assert "Tensors must be CUDA and dense" in rank_logs(daemon, job, 2)[0]


def losses(log: str) -> list[float]:
    """The losses a log's "... loss X" lines print, in order."""
    return [float(line.split(" loss ")[1].split()[0]) for line in log.splitlines() if " loss " in line]


def direct_alone(program: str, args: Sequence[str]) -> str:
    """The program's stdout run directly on the CPU as one process without torchrun's environment."""
    done = subprocess.run(
        [PYTHON, program, *args], cwd=PROGRAMS, env=base_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def without(lines: str, *words: str) -> str:
    """The lines that contain none of `words`."""
    return "".join(line for line in lines.splitlines(keepends=True) if not any(w in line for w in words))


RESET_INIT = ["--meta-init", "--reset-init"]


@pytest.mark.timeout(1500)
def test_programs_run_unmodified_with_1_2_and_4_ranks(daemon: Daemon) -> None:
    """A pytorch/examples-style DDP demo (the accelerator's default backend), a nanoGPT-style
    trainer (nccl because RANK is set), FSDP2 (also built on the meta device, and also given its
    weights by `reset_parameters()` there and gathered by `get_model_state_dict`), FSDP1 from a host
    model with DDP reloading saved weights after wrapping, and every raw
    collective run as jobs of 1, 2 and 4 ranks; with 1 and 2 ranks they print what the same
    program prints directly on the CPU. Tensor-parallel attention on 2 ranks prints the losses
    of the unsharded model on the CPU, to rounding, after moving its DTensors with `.cuda()`."""
    nano = ["--max_iters=6", "--eval_interval=3"]
    jobs = {
        ("example", 1): submit(daemon, "ddp_example.py", [], 1, 1),
        ("example", 2): submit(daemon, "ddp_example.py", [], 2, 2),
        ("example", 4): submit(daemon, "ddp_example.py", [], 4, 4),
        ("nano", 1): submit(daemon, "nanogpt_style.py", nano, 1, 1),
        ("nano", 2): submit(daemon, "nanogpt_style.py", nano, 2, 2),
        ("nano", 4): submit(daemon, "nanogpt_style.py", nano, 4, 4),
        ("fsdp", 2): submit(daemon, "fsdp_train.py", ["--steps", "3"], 2, 2),
        ("fsdp", 4): submit(daemon, "fsdp_train.py", ["--steps", "3"], 4, 4),
        ("fsdp-meta", 2): submit(daemon, "fsdp_train.py", ["--steps", "3", "--meta-init"], 2, 2),
        ("fsdp-reset", 2): submit(daemon, "fsdp_train.py", ["--steps", "3", *RESET_INIT], 2, 2),
        ("fsdp1", 2): submit(daemon, "fsdp1_train.py", [], 2, 2),
        ("tp", 2): submit(daemon, "tp_attention.py", [], 2, 2),
        ("raw", 2): submit(daemon, "raw_collectives.py", [], 2, 1),
        ("raw-gloo", 2): submit(daemon, "raw_collectives.py", ["--backend", "gloo"], 2, 2),
        ("raw", 4): submit(daemon, "raw_collectives.py", ["--backend", "gloo"], 4, 2),
    }
    example_ranks = tuple(f"rank {r} " for r in range(4))
    for ranks in (1, 2):
        direct = printed(direct_ranks("ddp_example.py", ["--cpu"], ranks), example_ranks)
        logs = succeeded(daemon, jobs[("example", ranks)], ranks)
        assert printed(logs, example_ranks) == direct
        assert all("backend=nccl" in log for log in logs)
    example = printed(succeeded(daemon, jobs[("example", 4)], 4), example_ranks)
    assert len({log.splitlines()[-1].split()[-1] for log in example}) == 1, (
        "every rank ends with the same weights"
    )

    kept = ("step ", "iter ", "done ")
    assert printed(succeeded(daemon, jobs[("nano", 1)], 1), kept) == [
        direct_alone("nanogpt_style.py", [*nano, "--device=cpu"])
    ]
    for ranks in (2, 4):
        master = printed(succeeded(daemon, jobs[("nano", ranks)], ranks), kept)[0]
        assert f"done in {ranks} process(es)" in master

    fsdp_direct = direct_ranks("fsdp_train.py", ["--steps", "3", "--device", "cpu"], 2)
    assert printed(succeeded(daemon, jobs[("fsdp", 2)], 2)) == fsdp_direct
    assert printed(succeeded(daemon, jobs[("fsdp-meta", 2)], 2)) == fsdp_direct  # to_empty of DTensors
    reset_direct = direct_ranks("fsdp_train.py", ["--steps", "3", "--device", "cpu", *RESET_INIT], 2)
    assert printed(succeeded(daemon, jobs[("fsdp-reset", 2)], 2)) == reset_direct  # DTensors' random init
    fsdp1_direct = direct_ranks("fsdp1_train.py", ["--device", "cpu"], 2)
    assert "rank 0 reloaded" in fsdp1_direct[0] and "rank 0 full state" in fsdp1_direct[0]
    assert printed(succeeded(daemon, jobs[("fsdp1", 2)], 2)) == fsdp1_direct  # FSDP1, DDP's reloads
    unsharded = losses(direct_alone("tp_attention.py", ["--plain", "--device", "cpu"]))
    halves = [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    for rank, log in enumerate(
        succeeded(daemon, jobs[("tp", 2)], 2)
    ):  # attention on DTensors sharded by heads
        assert losses(log) == pytest.approx(unsharded, rel=1e-6, abs=0)
        assert f"rank {rank} moved {halves[rank]} cuda:{rank}" in log
    fsdp = printed(succeeded(daemon, jobs[("fsdp", 4)], 4))
    assert len({log.splitlines()[-1].split()[-1] for log in fsdp}) == 1

    direct = direct_ranks("raw_collectives.py", ["--device", "cpu"], 2)
    proxied = printed(succeeded(daemon, jobs[("raw", 2)], 2))
    assert [without(log, "all_reduce_avg", "backend=") for log in proxied] == [
        without(log, "backend=") for log in direct
    ]
    assert all(f"rank {r} done backend=nccl" in log for r, log in enumerate(proxied))
    proxied = printed(succeeded(daemon, jobs[("raw-gloo", 2)], 2))  # gloo's path for device tensors
    assert proxied == direct
    four = printed(succeeded(daemon, jobs[("raw", 4)], 4))
    assert all(f"rank {r} done backend=gloo" in log for r, log in enumerate(four))


@requires_root
@pytest.mark.timeout(900)
def test_a_pipeline_preempted_while_messages_are_in_flight_is_exact(daemon_root: Path) -> None:
    """4 pipeline stages exchanging point-to-point messages (send/recv, batch_isend_irecv, a ring of
    isend then recv), one per device, preempted and resumed 3 times at random moments, print
    exactly what the program prints run directly with gloo, every rank. (Stages are not replicas:
    the daemon would not keep two on one device.)"""
    total, ranks = 300, 4
    args = ["--steps", str(total)]
    expected = direct_ranks("pipeline_train.py", [*args, "--device", "cpu"], ranks)
    with running_daemon(daemon_root, virtual_devices=ranks) as daemon:
        assert (
            preempted_run(daemon, "pipeline_train.py", args, ranks, total, 3, seed=7, spread=0.3) == expected
        )
