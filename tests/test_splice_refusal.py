"""Splicing refused to ranks that are not data-parallel replicas, through the real daemon.

A 2-rank program whose ranks train their own weights (splice_train.py --different: no DDP, a
seed per rank) is submitted with --ranks 2 --gpus 1. Its device's proxy server finds the ranks
hold different parameters; the daemon records that reason and stops splicing the job: with a
second device free it resizes the job to 2 devices, with none it checkpoints it and keeps it
waiting for 2, saying why. Either way the job prints exactly what it prints on 2 devices from
the start, and a resize back to 1 device is refused with the reason. The job waits for a file
the test creates before it ends, so every step of this hits a running job.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import requires_root
from tests.helpers import Daemon, running_daemon, wait_until
from tests.proxy.conftest import PYTHON
from tests.test_collectives import JOB_OPTIONS, printed, run_job, succeeded
from tests.test_elastic import hold_devices
from tests.test_splicing import devices_of, refused

RANKS = 2
NOT_REPLICAS = ["--width", "256", "--layers", "4", "--steps", "30", "--sleep", "0.05", "--different"]
REASON = "ranks 0 and 1 hold different parameters: not data-parallel replicas"
SEEDED_APART = ["--width", "256", "--layers", "4", "--steps", "30", "--sleep", "0.05", "--seed-per-rank"]


def submit_spliced(daemon: Daemon, release: Path) -> int:
    """The non-replica program with its 2 ranks on 1 device, waiting for `release` before it ends."""
    options = [*JOB_OPTIONS, "--ranks", str(RANKS), "--gpus", "1"]
    job = daemon.submit(PYTHON, "splice_train.py", *NOT_REPLICAS, "--hold", str(release), options=options)
    daemon.wait_state(job, "RUNNING")
    return job


def events(daemon: Daemon, job: int) -> list[dict[str, Any]]:
    """The job's event log."""
    return list(daemon.job(job)["events"])


def refusal_event(daemon: Daemon, job: int) -> dict[str, Any] | None:
    """The event that says the job's splicing was refused, once there is one."""
    return next((e for e in events(daemon, job) if e["reason"].startswith("splicing refused: ")), None)


def finished(daemon: Daemon, job: int, release: Path, ranks: int = RANKS) -> list[str]:
    """Let the job end; each rank's printed lines."""
    release.touch()
    return printed(succeeded(daemon, job, ranks, timeout=600))


def detected_after(daemon: Daemon, job: int) -> float:
    """Seconds from the job's start to the refusal event."""
    log = events(daemon, job)
    started = next(e["at"] for e in log if str(e["reason"]).startswith("started on"))
    found = refusal_event(daemon, job)
    assert found is not None
    return float(found["at"]) - float(started)


@requires_root
@pytest.mark.timeout(1200)
def test_ranks_that_are_not_replicas_stop_sharing_a_device(daemon_root: Path) -> None:
    """(a) a second device free: the job is resized to 2 devices, with the servers' reason in an
    event, and prints what it prints on 2 devices; (c) a resize back to 1 is refused with the reason;
    (b) no second device free: the job is checkpointed and waits for 2 devices, the reason in its
    pending reason, then runs to the same end once another job frees one."""
    with running_daemon(daemon_root, virtual_devices=RANKS) as daemon:
        expected = run_job(daemon, "splice_train.py", NOT_REPLICAS, ranks=RANKS, gpus=RANKS)
        assert all(f"rank {r} final " in text for r, text in enumerate(expected))

        release = daemon_root / "release-resized"
        job = submit_spliced(daemon, release)
        try:
            wait_until(lambda: refusal_event(daemon, job) is not None, timeout=300)
            found = refusal_event(daemon, job)
            assert (
                found is not None
                and REASON in found["reason"]
                and "resizing it to 2 devices" in found["reason"]
            )
            wait_until(
                lambda: daemon.job(job)["state"] == "RUNNING" and len(devices_of(daemon, job)) == RANKS,
                timeout=300,
            )
            result = daemon.sing("resize", str(job), "--gpus", "1")
            refused(result, 2, REASON)
            assert "cannot splice: " in result.err and "need one device each" in result.err
            assert len(devices_of(daemon, job)) == RANKS
            assert REASON in daemon.job(job)["splice_refusal"]
            assert "Splicing:   refused, one device per rank (" + REASON in daemon.sing("show", str(job)).out
        except BaseException:
            daemon.sing("cancel", str(job))
            raise
        assert finished(daemon, job, release) == expected
        print(f"resized: refusal {detected_after(daemon, job):.2f}s after the start")
        reasons = [e["reason"] for e in events(daemon, job)]
        assert sum(r.startswith("resized to 2 devices by the daemon") for r in reasons) == 1, reasons

        blocker_release = daemon_root / "release-blocker"
        blocker = hold_devices(daemon, 1, blocker_release)
        release = daemon_root / "release-waiting"
        job = submit_spliced(daemon, release)
        try:
            wait_until(lambda: daemon.job(job)["state"] == "PREEMPTED", timeout=300)
            found = refusal_event(daemon, job)
            assert found is not None and "checkpointing it until 2 devices" in found["reason"], found
            wait_until(lambda: REASON in (daemon.job(job)["pending_reason"] or ""), timeout=60)
            pending = daemon.job(job)["pending_reason"]
            assert pending.startswith("Resources: needs 2 devices, 1 free (one per rank: "), pending
            assert REASON in daemon.sing("ps").out
            blocker_release.touch()
            assert daemon.sing("wait", str(blocker), timeout=120).code == 0
            daemon.wait_state(job, "RUNNING", timeout=300)
            assert len(devices_of(daemon, job)) == RANKS
        except BaseException:
            daemon.sing("cancel", str(job))
            blocker_release.touch()
            raise
        assert finished(daemon, job, release) == expected
        print(f"waited: refusal {detected_after(daemon, job):.2f}s after the start")


@requires_root
@pytest.mark.timeout(900)
def test_replicas_seeded_apart_until_ddp_broadcasts_keep_sharing_a_device(daemon_root: Path) -> None:
    """Ranks that seed their own weights (as nanoGPT does) differ until DDP's first broadcast makes
    them rank 0's: the daemon must not refuse them splicing for what it saw before; they run to
    the end on 1 device and print what they print on 2."""
    with running_daemon(daemon_root, virtual_devices=RANKS) as daemon:
        expected = run_job(daemon, "splice_train.py", SEEDED_APART, ranks=RANKS, gpus=RANKS)
        options = [*JOB_OPTIONS, "--ranks", str(RANKS), "--gpus", "1"]
        job = daemon.submit(PYTHON, "splice_train.py", *SEEDED_APART, options=options)
        assert printed(succeeded(daemon, job, RANKS, timeout=600)) == expected
        assert refusal_event(daemon, job) is None, events(daemon, job)
        assert not daemon.job(job)["splice_refusal"]


MESH_RANKS = 4
MESH = [*NOT_REPLICAS, "--groups-of", "2"]


@requires_root
@pytest.mark.timeout(900)
def test_ranks_of_a_mesh_that_meet_only_in_sub_groups_stop_sharing_a_device(daemon_root: Path) -> None:
    """4 ranks with their own weights whose collectives are all of sub-groups of 2 (as a 2-D mesh
    of tensor and data parallelism runs them) on 1 device: no collective of every rank comes to
    judge them at, yet they are found out and resized to 4 devices, and print what they print
    on 4 devices from the start."""
    with running_daemon(daemon_root, virtual_devices=MESH_RANKS) as daemon:
        expected = run_job(daemon, "splice_train.py", MESH, ranks=MESH_RANKS, gpus=MESH_RANKS)
        release = daemon_root / "release-mesh"
        options = [*JOB_OPTIONS, "--ranks", str(MESH_RANKS), "--gpus", "1"]
        job = daemon.submit(PYTHON, "splice_train.py", *MESH, "--hold", str(release), options=options)
        try:
            wait_until(lambda: refusal_event(daemon, job) is not None, timeout=300)
            found = refusal_event(daemon, job)
            assert found is not None and "not data-parallel replicas" in found["reason"], found
            assert "resizing it to 4 devices" in found["reason"], found
            wait_until(
                lambda: daemon.job(job)["state"] == "RUNNING" and len(devices_of(daemon, job)) == MESH_RANKS,
                timeout=300,
            )
        except BaseException:
            daemon.sing("cancel", str(job))
            raise
        assert finished(daemon, job, release, MESH_RANKS) == expected
        print(f"mesh: refusal {detected_after(daemon, job):.2f}s after the start")
