"""Hugging Face's Trainer, unmodified, through the real daemon: a 2-rank DDP job spliced on one
device, preempted and checkpointed during its run, logs what it logs on 2 devices, every rank,
and saves byte-identical Trainer checkpoints (safetensors weights, optimizer state)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import requires_root
from tests.helpers import running_daemon
from tests.proxy.conftest import PYTHON
from tests.test_collectives import JOB_OPTIONS, run_job
from tests.test_elastic import at_gate
from tests.test_splice_refusal import finished

RANKS = 2
STEPS = 24
SAVED = ("model.safetensors", "optimizer.pt")


def saves(out: Path) -> dict[str, bytes]:
    """The weights and optimizer state of every checkpoint the Trainer saved, by path."""
    return {
        f"{folder.name}/{name}": (folder / name).read_bytes()
        for folder in sorted(out.glob("checkpoint-*"))
        for name in SAVED
    }


@requires_root
@pytest.mark.timeout(900)
def test_a_trainer_job_spliced_and_preempted_logs_and_saves_exactly_as_on_two_devices(
    daemon_root: Path,
) -> None:
    with running_daemon(daemon_root, virtual_devices=RANKS) as daemon:
        two = daemon_root / "two"
        expected = run_job(daemon, "hf_trainer.py", ["--out", str(two)], RANKS, RANKS)
        assert all(f"rank {rank} final " in text for rank, text in enumerate(expected))
        assert "eval_loss" in expected[0] and f"rank 1 step {STEPS} " in expected[1]

        release = daemon_root / "release"
        out = daemon_root / "spliced"
        program = [PYTHON, "hf_trainer.py", "--out", str(out), "--sleep", "0.1", "--hold", str(release)]
        job = daemon.submit(*program, options=[*JOB_OPTIONS, "--ranks", str(RANKS), "--gpus", "1"])
        try:
            daemon.wait_state(job, "RUNNING")
            at_gate(daemon, job, 6, RANKS)
            assert daemon.sing("preempt", str(job)).code == 0
            daemon.wait_state(job, "RUNNING", timeout=300)
            at_gate(daemon, job, 14, RANKS)
            assert daemon.sing("checkpoint", str(job)).code == 0
        except BaseException:
            daemon.sing("cancel", str(job))
            raise
        assert finished(daemon, job, release, RANKS) == expected
        assert list(saves(out)) == [f"checkpoint-{s}/{n}" for s in (16, 24, 8) for n in SAVED]
        assert saves(out) == saves(two)
