"""An unmodified PyTorch Lightning program through the real daemon: its Trainer finds the ranks by
torchrun's variables, and a 4-rank DDP job resized 4 -> 1 -> 3 and preempted during its run
prints what it prints on 4 devices, every rank, and saves the same Lightning checkpoint."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import requires_root
from tests.helpers import running_daemon
from tests.proxy.conftest import PYTHON
from tests.test_collectives import JOB_OPTIONS, run_job, submit, succeeded
from tests.test_elastic import ELASTIC, at_gate, on_devices, resized_to
from tests.test_splice_refusal import finished

RANKS = 4
EPOCHS = 4
STEPS = 8 * EPOCHS


def lightning_checkpoint(out: Path) -> dict[str, Any]:
    """What Lightning saved at the end of the run, less its own folder's paths (the runs' differ)."""
    (path,) = (out / "lightning_logs" / "version_0" / "checkpoints").glob("*.ckpt")
    saved = torch.load(path, map_location="cpu", weights_only=False)
    return {
        key: saved[key]
        for key in ("epoch", "global_step", "state_dict", "optimizer_states", "lr_schedulers", "loops")
    }


def same(first: object, second: object) -> bool:
    """Whether two loaded checkpoints are equal, tensors bit for bit."""
    if isinstance(first, torch.Tensor):
        return (
            isinstance(second, torch.Tensor)
            and (first.dtype, first.shape) == (second.dtype, second.shape)
            and torch.equal(first.view(-1).view(torch.uint8), second.view(-1).view(torch.uint8))
        )
    if isinstance(first, dict):
        return (
            isinstance(second, dict)
            and first.keys() == second.keys()
            and all(same(first[k], second[k]) for k in first)
        )
    if isinstance(first, (list, tuple)):
        return (
            type(first) is type(second)
            and isinstance(second, (list, tuple))
            and len(first) == len(second)
            and all(same(a, b) for a, b in zip(first, second, strict=True))
        )
    return first == second


@requires_root
@pytest.mark.timeout(900)
def test_a_lightning_job_resized_and_preempted_runs_exactly_as_on_four_devices(daemon_root: Path) -> None:
    keep_sizes = {"elastic_grow_seconds": 3600.0}  # only the test's resizes: the scheduler grows none
    with running_daemon(daemon_root, virtual_devices=RANKS, config=keep_sizes) as daemon:
        expected = run_job(
            daemon,
            "lightning_train.py",
            ["--epochs", str(EPOCHS), "--out", str(daemon_root / "four")],
            RANKS,
            RANKS,
        )
        assert all(f"rank {rank} step {STEPS - 1} " in text for rank, text in enumerate(expected))
        assert "rank 0 final " in expected[0] and "val_loss" in expected[0]

        release = daemon_root / "release"
        out = daemon_root / "elastic"
        program = [
            PYTHON,
            "lightning_train.py",
            "--epochs",
            str(EPOCHS),
            "--out",
            str(out),
            "--sleep",
            "0.05",
        ]
        job = daemon.submit(*program, "--hold", str(release), options=[*JOB_OPTIONS, *ELASTIC])
        try:
            on_devices(daemon, job, RANKS)
            for steps, gpus in ((6, 1), (14, 3)):
                at_gate(daemon, job, steps, RANKS)
                assert daemon.sing("resize", str(job), "--gpus", str(gpus)).code == 0
                on_devices(daemon, job, gpus)
            at_gate(daemon, job, 22, RANKS)
            assert daemon.sing("preempt", str(job)).code == 0
            daemon.wait_state(job, "RUNNING", timeout=300)
        except BaseException:
            daemon.sing("cancel", str(job))
            raise
        assert finished(daemon, job, release, RANKS) == expected
        assert resized_to(daemon, job) == [1, 3]
        assert same(lightning_checkpoint(out), lightning_checkpoint(daemon_root / "four"))


PRINTED = re.compile(r"rank \d+ (?:step \d+ loss -?\d+\.\d{10}|final [0-9a-f]{32})")
"""A rank's loss or final checksum line, found also where two processes' lines ran together."""


@requires_root
@pytest.mark.timeout(900)
def test_one_process_on_two_devices_launches_its_own_ranks_as_on_a_workstation(daemon_root: Path) -> None:
    """`sing submit --gpus 2 python train.py` of an unmodified Lightning program: the one process
    gets no torchrun variables (they told Lightning its world was one process: "You set devices=2
    ... does not match the world size (1)"), so Lightning starts its second rank itself, as on a
    two-GPU workstation, and both ranks print what a job of two ranks prints."""
    args = ["--epochs", "2"]
    with running_daemon(daemon_root, virtual_devices=2) as daemon:
        ranks = run_job(daemon, "lightning_train.py", [*args, "--out", str(daemon_root / "two")], 2, 2)
        one = submit(daemon, "lightning_train.py", [*args, "--out", str(daemon_root / "one")], 1, 2)
        (log,) = succeeded(daemon, one, 1)
    expected = sorted(PRINTED.findall("".join(ranks)))
    assert any(line.startswith("rank 1 step") for line in expected)
    assert sorted(PRINTED.findall(log)) == expected  # both ranks write the one process's log
