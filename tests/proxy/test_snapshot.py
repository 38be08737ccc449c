"""Saves with pre-copy hold exactly the state of the pause, however the job wrote its tensors meanwhile.

A job (tests/programs/mutator.py) writes its tensors in every way the proxy must notice while
the server pre-copies them; in the pause the state is captured, and a full save of the same
parked state (read straight from the device) is taken beside it. Both files must hold the same
tensors, byte for byte, with the same sharing of storages.
"""

from __future__ import annotations

import os
import random
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from singularity.proxy.bootstrap._singularity_proxy import protocol
from singularity.proxy.control import ControlError, JobNotOnServer, ProxyControl
from singularity.proxy.server.control import ControlHandler, control_failure
from singularity.proxy.server.service import Server
from singularity.proxy.server.session import Session
from singularity.proxy.server.snapshot import SaveReport
from singularity.proxy.server.statefile import SavedSession, read_state, storage_bytes
from singularityd.checkpoint.pause import DeviceSaveFigures
from tests.proxy.conftest import PROGRAMS, PYTHON, ProxyServer, proxy_env, start_server, stop_server


def state_of(path: Path) -> list[SavedSession]:
    """The sessions a device-state file holds, on the CPU."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_state(fd, torch.device("cpu"))[1]
    finally:
        os.close(fd)


def layout(tensor: torch.Tensor) -> tuple[object, ...]:
    """What must match besides the bytes."""
    return (tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), tensor.is_conj())


def assert_same_state(got: list[SavedSession], expected: list[SavedSession]) -> None:
    """Same sessions, handles, layouts, bytes of every storage, and the same storage sharing."""
    assert [(s.job_id, s.rank, s.ops) for s in got] == [(s.job_id, s.rank, s.ops) for s in expected]
    assert [s.plans for s in got] == [s.plans for s in expected]
    assert any(s.plans for s in expected), "the job's repeated operations were planned, and the plans saved"
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.tensors.keys() == theirs.tensors.keys()
        shared_mine: dict[int, list[int]] = {}
        shared_theirs: dict[int, list[int]] = {}
        for handle in sorted(theirs.tensors):
            a, b = mine.tensors[handle], theirs.tensors[handle]
            assert layout(a) == layout(b), handle
            assert torch.equal(storage_bytes(a.untyped_storage()), storage_bytes(b.untyped_storage())), (
                f"handle {handle}: the pre-copied save holds other bytes than the device had in the pause"
            )
            shared_mine.setdefault(a.untyped_storage()._cdata, []).append(handle)
            shared_theirs.setdefault(b.untyped_storage()._cdata, []).append(handle)
        assert sorted(shared_mine.values()) == sorted(shared_theirs.values())


def start_mutator(device: ProxyServer, job_id: str, hold: Path, *seed: str) -> subprocess.Popen[str]:
    """The mutator program writing its tensors on `device` until `hold` exists, once it is ready."""
    job = subprocess.Popen(
        [PYTHON, "mutator.py", str(hold), *seed],
        cwd=PROGRAMS,
        env=proxy_env([device.socket], job_id),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if job.stdout is None or job.stdout.readline() != "ready\n":
        job.kill()
        _, err = job.communicate()
        raise AssertionError(f"the mutator did not start: {err}")
    return job


@pytest.fixture
def device(tmp_path: Path) -> Iterator[ProxyServer]:
    """A server of its own (2 GiB), so that the job's writes are the only ones."""
    server = start_server(tmp_path, "snap", memory_bytes=2 << 30)
    yield server
    stop_server(server)


def test_precopied_saves_equal_full_saves_of_the_same_pause(device: ProxyServer, tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    job = start_mutator(device, "snap-job", hold, "3")
    try:
        rng = random.Random(5)
        reused = copied = dirtied = 0
        with ProxyControl(device.control, timeout=None) as control:
            for i in range(6):
                copy = i % 3 != 2  # a checkpoint in place copies; a preemption reads the device later
                precopied, full = tmp_path / f"precopied-{i}", tmp_path / f"full-{i}"
                prepared = control.prepare("snap-job", precopied, rounds=rng.randint(1, 3), budget_s=60)
                assert control.quiesce("snap-job") == [0]
                captured = control.capture("snap-job", copy=copy)
                control.save("snap-job", full)
                if copy:
                    control.resume("snap-job")
                report = control.finish("snap-job")
                if not copy:
                    control.resume("snap-job")
                assert_same_state(state_of(precopied), state_of(full))
                assert captured["parked_at"] and report["file_bytes"] == precopied.stat().st_size
                reused += report["reused_bytes"]
                copied += report["paused_copied_bytes"] + (0 if copy else report["written_after_bytes"])
                dirtied += prepared["precopy_dirtied_bytes"]
                precopied.unlink()
                full.unlink()
        hold.touch()
        out, err = job.communicate(timeout=120)
        assert job.returncode == 0, err
        assert out.startswith("steps True")
    finally:
        job.kill()
        job.wait()
    assert reused >= 64 << 20, "the tensor that is only read was taken from its pre-copy"
    assert copied > 0, "what the job wrote was copied in the pause"
    assert dirtied > 0 or copied > 0


FUSED_STEP = """
import os, sys, time, torch
go, hold = sys.argv[1], sys.argv[2]
params = [torch.randn(64, 64, device="cuda", requires_grad=True) for _ in range(2)]
optimizer = torch.optim.Adam(params, lr=0.1, fused=True)
def step():
    sum((p * p).sum() for p in params).backward()
    optimizer.step()
    optimizer.zero_grad()
    params[0].sum().item()
step()
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.01)
step()
print("stepped", flush=True)
while not os.path.exists(hold):
    time.sleep(0.01)
"""


def script_job(device: ProxyServer, script: str, job_id: str, tmp_path: Path) -> subprocess.Popen[str]:
    """A proxied job running `script` with its go and hold files (tmp_path/go, tmp_path/hold) as
    arguments, once it has printed "ready"."""
    job = subprocess.Popen(
        [PYTHON, "-c", script, str(tmp_path / "go"), str(tmp_path / "hold")],
        env=proxy_env([device.socket], job_id),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert job.stdout is not None and job.stdout.readline() == "ready\n"
    return job


def pre_copied_then_paused(
    device: ProxyServer, job_id: str, tmp_path: Path, meanwhile: Callable[[], None]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Pre-copy the job's state (into tmp_path/a), run `meanwhile`, capture it in a pause and save
    it in full (tmp_path/b) beside: the two files must hold the same state. The answers of the
    pre-copy and of the capture."""
    with ProxyControl(device.control, timeout=None) as control:
        prepared = control.prepare(job_id, tmp_path / "a", rounds=1, budget_s=60)
        meanwhile()
        control.quiesce(job_id)
        captured = control.capture(job_id, copy=True)
        control.save(job_id, tmp_path / "b")
        control.resume(job_id)
        control.finish(job_id)
    assert_same_state(state_of(tmp_path / "a"), state_of(tmp_path / "b"))
    return prepared, captured


def test_writes_of_kernels_that_keep_version_counters_are_seen(device: ProxyServer, tmp_path: Path) -> None:
    """A fused optimizer step between the pre-copy and the pause (its kernel bumps no version)."""
    job = script_job(device, FUSED_STEP, "fused-job", tmp_path)
    try:

        def step() -> None:
            (tmp_path / "go").touch()
            assert job.stdout is not None and job.stdout.readline() == "stepped\n"

        prepared, _ = pre_copied_then_paused(device, "fused-job", tmp_path, step)
        assert prepared["precopy_written_bytes"] >= 2 * 64 * 64 * 4 * 3  # parameters, Adam's state
        (tmp_path / "hold").touch()
        assert job.wait(120) == 0
    finally:
        job.kill()
        job.wait()


SLICED_READER = """
import os, sys, time, torch
go, hold = sys.argv[1], sys.argv[2]
static = torch.ones(16 << 20, device="cuda")  # 64 MiB, only read, through a new slice each step
total = torch.zeros((), device="cuda")
def step(i):
    part = static[(i % 16) << 20 : ((i % 16) + 1) << 20]
    total.add_(part.sum())
step(0)
total.item()
print("ready", flush=True)
i = 1
while not os.path.exists(hold):
    step(i)
    i += 1
    if os.path.exists(go):
        total.item()
    time.sleep(0.002)
print("steps", i, flush=True)
"""


def test_a_tensor_only_read_through_new_slices_is_taken_from_its_pre_copy(
    device: ProxyServer, tmp_path: Path
) -> None:
    """Views made and freed between the pre-copy and the pause leave their base's record good."""
    job = script_job(device, SLICED_READER, "sliced-job", tmp_path)
    try:

        def slice_a_while() -> None:
            (tmp_path / "go").touch()
            time.sleep(0.5)

        prepared, captured = pre_copied_then_paused(device, "sliced-job", tmp_path, slice_a_while)
        assert prepared["precopy_written_bytes"] >= 64 << 20
        assert captured["reused_bytes"] >= 64 << 20, captured
        assert captured["copied_bytes"] < 1 << 20, captured
        (tmp_path / "hold").touch()
        assert job.wait(120) == 0
    finally:
        job.kill()
        job.wait()


def test_a_save_without_precopy_copies_everything_in_the_pause(device: ProxyServer, tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    job = start_mutator(device, "plain-job", hold)
    try:
        with ProxyControl(device.control, timeout=None) as control:
            prepared = control.prepare("plain-job", tmp_path / "a", rounds=0, budget_s=0)
            assert prepared["precopy_written_bytes"] == 0 and prepared["staged_bytes"] > 96 << 20
            control.quiesce("plain-job")
            captured = control.capture("plain-job", copy=True)
            control.save("plain-job", tmp_path / "b")
            control.resume("plain-job")
            report = control.finish("plain-job")
        assert captured["reused_bytes"] == 0 and captured["copied_bytes"] == report["paused_copied_bytes"]
        assert report["paused_copied_bytes"] > 96 << 20, "the two large tensors were copied in the pause"
        assert_same_state(state_of(tmp_path / "a"), state_of(tmp_path / "b"))
        hold.touch()
        assert job.wait(120) == 0
    finally:
        job.kill()
        job.wait()


def test_the_work_a_session_received_and_its_groups_are_saved_and_restored(tmp_path: Path) -> None:
    """A parked session's queue of received-not-run frames, its collective groups and its numeric
    settings (default dtype, oneDNN's precisions) go into the device-state file (pre-copied or
    not) and come back, held until resume, after a load."""
    queue = [[[[protocol.OP_FREE, [7]]], [protocol.REQ_SYNC], True, [b"\x01\x02"]]]
    groups = {"world": (1, [0, 1])}
    source = Server(0, 1 << 30, None)
    session = Session("q-job", 1, os.getuid(), source.memory)
    session.add(1, torch.arange(16, dtype=torch.float32))
    session.settings = {
        "default_dtype": "float64",
        "mkldnn": True,
        "fp32_precision": ["none", "bf16", "none", "none"],
    }
    session.parked = True
    source.add_session(session, queue, groups)
    control = ControlHandler(source)
    try:
        precopied, full = tmp_path / "precopied", tmp_path / "full"
        with precopied.open("wb") as file:
            control.snapshots.prepare("q-job", file.fileno(), rounds=1, budget_s=60, stage=True)
            control.snapshots.capture("q-job", copy=True)
            control.snapshots.finish("q-job", 60)
        with full.open("wb") as file:
            control.save("q-job", file.fileno())
        for path in (precopied, full):
            (saved,) = state_of(path)
            assert (saved.queue, saved.groups, saved.settings) == (queue, groups, session.settings)
            target = Server(0, 1 << 30, None)
            try:
                with path.open("rb") as file:
                    ControlHandler(target).load("q-job", file.fileno())
                (runner,) = target.job_runners("q-job")
                assert runner.held and runner.groups == groups and runner.saved_queue() == queue
                assert target.job_sessions("q-job")[0].settings == session.settings
                assert torch.equal(target.job_sessions("q-job")[0].tensor(1), torch.arange(16.0))
            finally:
                for restored in target.job_sessions("q-job"):
                    target.drop(restored)
    finally:
        source.drop(session)


def test_a_save_of_a_job_whose_processes_ended_here_says_so_plainly(
    server: ProxyServer, tmp_path: Path
) -> None:
    """A job whose processes ended has nothing left on the device: the failure has its own kind,
    and its message is the server's plain text (no Python class name, no quoting) the daemon shows."""
    device = Server(0, 1 << 30, None)
    session = Session("5", 0, os.getuid(), device.memory)
    device.add_session(session)
    device.drop(session)
    control = ControlHandler(device)
    with (tmp_path / "gone.state").open("wb") as file, pytest.raises(LookupError) as failure:
        control.snapshots.prepare("5", file.fileno(), rounds=1, budget_s=10.0, stage=True)
    assert control_failure(failure.value) == [
        protocol.CONTROL_JOB_NOT_HERE,
        "proxy: job 5 has nothing on device 0",
    ]
    requests: list[Callable[[ProxyControl], object]] = [
        lambda control: control.capture("5", copy=True),
        lambda control: control.finish("5"),
    ]
    for request in requests:  # through a server's socket, of a job that had no session there
        with ProxyControl(server.control) as remote, pytest.raises(ControlError) as refused:
            request(remote)
        assert not isinstance(refused.value, JobNotOnServer)


def test_a_job_that_never_used_a_device_saves_nothing_there(tmp_path: Path) -> None:
    """A job given a device it never used (a program that uses the first of two) has nothing to
    save there: its save goes through, an empty device state, and the checkpoint with it."""
    control = ControlHandler(Server(1, 1 << 30, None))
    path = tmp_path / "unused.state"
    with path.open("wb") as file:
        control.snapshots.prepare("7", file.fileno(), rounds=1, budget_s=10.0, stage=True)
    assert control.quiesce("7", timeout=5.0) == []
    control.snapshots.capture("7", copy=True)
    control.snapshots.finish("7", timeout=30.0)
    assert state_of(path) == []


def test_control_failures_carry_the_errors_own_text() -> None:
    """Any other failure is answered with its message alone: a KeyError's without its quotes."""
    assert control_failure(KeyError("proxy: no tensor 3")) == [protocol.CONTROL_ERROR, "proxy: no tensor 3"]
    assert control_failure(TimeoutError()) == [
        protocol.CONTROL_ERROR,
        "proxy: the request failed without saying why",
    ]


def test_an_unsettled_pre_copy_says_how_much_the_job_changed_while_it_was_saved() -> None:
    """The event's reason for a pre-copy that could not get ahead is the share of the saved state
    the job changed meanwhile and the rate it was saved at; nothing when it settled."""
    figures = DeviceSaveFigures(
        live_bytes=100 << 20, precopy_rounds=1, precopy_written_bytes=100 << 20,
        precopy_dirtied_bytes=98 << 20, precopy_seconds=0.5, precopy_ended="unsettled",
    )  # fmt: skip
    assert figures.unsettled == (
        "the job changed 98% of its device state while the pre-copy saved it at 200.0M/s, "
        "so the pause copies what changed"
    )
    assert replace(figures, precopy_ended="settled").unsettled == ""
    assert replace(figures, precopy_written_bytes=0).unsettled == ""


def test_the_daemon_sums_the_figures_each_server_reports_for_its_device() -> None:
    """A server's SaveReport (one device's save) carries every figure the daemon's
    DeviceSaveFigures (the job's save, over its devices) sums: bytes add up, the longest time
    counts, one unsettled pre-copy makes the job's unsettled."""
    assert {f.name for f in fields(DeviceSaveFigures)} <= {f.name for f in fields(SaveReport)}
    first = SaveReport(
        live_bytes=100, precopy_rounds=2, precopy_written_bytes=80, precopy_dirtied_bytes=8,
        precopy_seconds=1.5, precopy_sync_seconds=0.25, precopy_ended="settled", reused_bytes=70,
        paused_copied_bytes=30, pause_copy_seconds=0.5, written_after_bytes=30, write_after_seconds=2.0,
    )  # fmt: skip
    second = SaveReport(
        live_bytes=50, precopy_rounds=3, precopy_written_bytes=40, precopy_dirtied_bytes=40,
        precopy_seconds=1.0, precopy_sync_seconds=0.5, precopy_ended="unsettled", reused_bytes=10,
        paused_copied_bytes=40, pause_copy_seconds=0.75, written_after_bytes=40, write_after_seconds=1.0,
        written_in_pause=True, ranks=2, parked_at=[1.0, 2.0],
    )  # fmt: skip
    assert DeviceSaveFigures.summed([first.as_dict(), second.as_dict()]) == DeviceSaveFigures(
        live_bytes=150, precopy_rounds=3, precopy_written_bytes=120, precopy_dirtied_bytes=48,
        precopy_seconds=1.5, precopy_sync_seconds=0.5, precopy_ended="unsettled", reused_bytes=80,
        paused_copied_bytes=70, pause_copy_seconds=0.75, written_after_bytes=70, write_after_seconds=2.0,
        written_in_pause=True,
    )  # fmt: skip
