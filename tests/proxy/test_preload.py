"""A restore that takes storages preloaded from the pre-copied part of its file loads the same state.

A job (tests/programs/mutator.py) is saved with pre-copy on one server; the records its pre-copy
wrote are preloaded into a second server, which then loads the whole file. What it holds must be
the same, byte for byte and in its sharing of storages, as a plain load of the file; records the
index does not name are read from the file, and a preload over the device's capacity holds nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from singularity.proxy.control import ControlError, ProxyControl
from singularity.proxy.server.statefile import ALIGN
from tests.proxy.conftest import ProxyServer, start_server, stop_server
from tests.proxy.test_snapshot import assert_same_state, start_mutator, state_of

JOB = "preload-job"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[list[int]]]]:
    """A device-state file saved with pre-copy while the job wrote its tensors, and its pre-copied records."""
    folder = tmp_path_factory.mktemp("preload-source")
    source = start_server(folder, "source", memory_bytes=2 << 30)
    hold = folder / "hold"
    try:
        job = start_mutator(source, JOB, hold, "7")
    except BaseException:
        stop_server(source)
        raise
    try:
        path = folder / "cuda0.state"
        with ProxyControl(source.control, timeout=None) as control:
            prepared = control.prepare(JOB, path, rounds=2, budget_s=60)
            control.quiesce(JOB)
            control.capture(JOB, copy=False)
            report = control.finish(JOB)
            control.release(JOB)
        hold.touch()
        records = prepared["precopy_records"]
        assert sum(n for _, n in records) >= 64 << 20, "the tensor only read was pre-copied"
        assert report["reused_bytes"] >= 64 << 20
        yield path, records
    finally:
        job.kill()
        job.wait()
        stop_server(source)


@pytest.fixture
def target(tmp_path: Path) -> Iterator[ProxyServer]:
    """The server the job is restored on."""
    server = start_server(tmp_path, "target", memory_bytes=2 << 30)
    yield server
    stop_server(server)


def load_and_save(control: ProxyControl, path: Path, out: Path) -> dict[str, Any]:
    """Load the job from `path`, save what the server then holds into `out`, release it; the load's report."""
    loaded = control.load(JOB, path)
    control.save(JOB, out)
    control.release(JOB)
    return loaded


def test_a_preloaded_load_holds_what_a_plain_load_holds(
    saved: tuple[Path, list[list[int]]], target: ProxyServer, tmp_path: Path
) -> None:
    path, records = saved
    with ProxyControl(target.control, timeout=None) as control:
        plain = load_and_save(control, path, tmp_path / "plain")
        preloaded = control.preload(JOB, path, [(o, n) for o, n in records])
        assert preloaded["refused"] == ""
        assert preloaded["preloaded_bytes"] == sum(n for _, n in records if n)
        assert control.status()["preloaded"] == {JOB: preloaded["preloaded_bytes"]}
        assert control.status()["allocated"] == preloaded["preloaded_bytes"]
        taken = load_and_save(control, path, tmp_path / "taken")
        status = control.status()
    assert plain["preloaded_bytes"] == 0
    assert taken["preloaded_bytes"] > 0 and taken["live_bytes"] == plain["live_bytes"]
    assert taken["preloaded_bytes"] + taken["unused_preloaded_bytes"] == preloaded["preloaded_bytes"]
    assert status["preloaded"] == {} and status["allocated"] == 0
    assert_same_state(state_of(tmp_path / "taken"), state_of(tmp_path / "plain"))
    assert_same_state(state_of(tmp_path / "taken"), state_of(path))


def test_the_load_takes_the_preloaded_bytes_and_reads_the_rest(
    saved: tuple[Path, list[list[int]]], target: ProxyServer, tmp_path: Path
) -> None:
    """Records preloaded from a copy whose pre-copied part was changed afterwards show which bytes the
    load took: those of the preload where its records match the index, the file's elsewhere."""
    path, records = saved
    changed = tmp_path / "changed"
    changed.write_bytes(path.read_bytes())
    with ProxyControl(target.control, timeout=None) as control:
        control.preload(JOB, changed, [(o, n) for o, n in records])
        fd = os.open(changed, os.O_WRONLY)
        try:
            for offset, nbytes in records:
                os.pwrite(fd, b"\xff" * min(nbytes, 64), offset)  # after the preload: not seen by it
        finally:
            os.close(fd)
        taken = load_and_save(control, changed, tmp_path / "taken")
        assert taken["preloaded_bytes"] >= 64 << 20, "the tensor only read was taken preloaded"
        # a record that the index does not name the same way: not taken, the file's bytes are read
        biggest = max(records, key=lambda r: r[1])
        control.preload(JOB, path, [(biggest[0], biggest[1] - ALIGN), (biggest[0] + ALIGN, ALIGN)])
        mismatched = load_and_save(control, path, tmp_path / "mismatched")
        assert control.status()["preloaded"] == {}
    assert mismatched["preloaded_bytes"] == 0 and mismatched["unused_preloaded_bytes"] == biggest[1]
    assert_same_state(state_of(tmp_path / "taken"), state_of(path))
    assert_same_state(state_of(tmp_path / "mismatched"), state_of(path))


def test_a_preload_over_capacity_holds_nothing(saved: tuple[Path, list[list[int]]], tmp_path: Path) -> None:
    path, records = saved
    small = start_server(tmp_path, "small", memory_bytes=48 << 20)
    try:
        with ProxyControl(small.control, timeout=None) as control:
            refused = control.preload(JOB, path, [(o, n) for o, n in records])
            assert refused["preloaded_bytes"] == 0 and "do not fit" in refused["refused"]
            assert control.status()["preloaded"] == {} and control.status()["allocated"] == 0
            with pytest.raises(ControlError, match="outside the file"):
                control.preload(JOB, path, [(path.stat().st_size, ALIGN)])
            part = (records[0][0], ALIGN)  # fits; the index names no such record
            assert control.preload(JOB, path, [part])["preloaded_bytes"] == ALIGN
            assert control.release(JOB) == ALIGN, "a release frees what was preloaded"
            assert control.status()["allocated"] == 0
    finally:
        stop_server(small)
