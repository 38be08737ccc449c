"""A spliced rank that waits at a collective keeps what it alone holds in host memory
(collectives.py `_move_off`, Session.swap_out/swap_in), on a Server object in this process: the
device's counts, the dedup, an all-reduce that reads a waiting member from the host, an operation
that brings its storage back, and a checkpoint taken meanwhile. The real-program figures (the
peak of 4 spliced ranks, with the turns and without) are in test_dedup_processes.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from singularity.proxy.bootstrap._singularity_proxy import protocol
from singularity.proxy.server import session as session_module
from singularity.proxy.server import snapshot as snapshot_module
from singularity.proxy.server.collective_kinds import allreduce
from singularity.proxy.server.collectives import SWAP_MIN_BYTES, Exchange, Instance
from singularity.proxy.server.service import Server
from singularity.proxy.server.snapshot import Snapshots
from singularity.proxy.server.statefile import storage_bytes
from tests.proxy.test_dedup import JOB, handle, load_job, open_sessions, run, save_job, server

__all__ = ["server"]  # the fixture, shared with test_dedup.py


@pytest.fixture(params=["handed over", "copied"])
def moves(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """How storages move to host memory: a virtual device hands its memory over; a GPU's bytes
    are copied (forced here on the virtual device, so that both ways are tested)."""
    if request.param == "copied":
        monkeypatch.setattr(session_module, "_CAN_HAND_OVER", False)


@pytest.fixture
def state_fd(tmp_path: Path) -> Iterator[int]:
    """An open, empty file for a save's device state (tmp_path / "state"), closed after the test."""
    fd = os.open(tmp_path / "state", os.O_RDWR | os.O_CREAT, 0o600)
    yield fd
    os.close(fd)


@pytest.fixture
def saves(server: Server, state_fd: int) -> Iterator[Snapshots]:
    """The server's saves, written by one thread; a save the test left open is aborted (its writer
    stopped) before the state file closes."""
    snapshots = Snapshots(server, copy_threads=1)
    yield snapshots
    snapshots.abort(JOB)


def test_a_virtual_device_hands_its_memory_to_the_host_without_copying(server: Server) -> None:
    """On a virtual device the device's memory is host memory: moving a storage off hands the
    same bytes to the host tensor, and bringing it back returns them, with no copy either way."""
    first, _second = open_sessions(server, 2)
    floats = SWAP_MIN_BYTES // 4
    first.add(1, torch.arange(floats, dtype=torch.float32))
    storage = first.tensors[1].untyped_storage()
    address, key = storage.data_ptr(), storage._cdata
    assert first.swap_out(key)
    assert first.swapped[key].data_ptr() == address and storage.nbytes() == 0
    assert torch.equal(first.swapped[key].view(torch.float32), torch.arange(floats, dtype=torch.float32))
    first.swap_in(key)
    assert storage.data_ptr() == address and storage.nbytes() == floats * 4
    assert torch.equal(first.tensors[1], torch.arange(floats, dtype=torch.float32))


@pytest.mark.usefixtures("moves")
def test_host_bytes_a_collective_reads_outlive_the_storage_coming_back(server: Server) -> None:
    """A collective reading a waiting rank's tensor from host memory keeps reading those bytes
    when the storage comes back to the device meanwhile (a checkpoint's pre-copy brings every
    storage back while a cross-server all-reduce waits for its parts): the memory under the
    reader is not handed back from under it, but copied; once the reader is done, it is handed."""
    first, _second = open_sessions(server, 2)
    floats = SWAP_MIN_BYTES // 4
    first.add(1, torch.arange(floats, dtype=torch.float32))
    key = first.tensors[1].untyped_storage()._cdata
    assert first.swap_out(key)
    read = first.readable(first.tensors[1])
    first.swap_in_all()
    assert read.untyped_storage().data_ptr() != 0 and read.untyped_storage().nbytes() == floats * 4
    assert torch.equal(read, torch.arange(floats, dtype=torch.float32))
    assert torch.equal(first.tensors[1], torch.arange(floats, dtype=torch.float32))
    assert first.swap_out(key)  # once the reader is done with them, the bytes are handed back
    address = first.swapped[key].data_ptr()
    first.readable(first.tensors[1])
    first.done_reading(first.tensors[1])
    first.swap_in(key)
    assert not first.read_on_host
    handed = session_module._CAN_HAND_OVER
    assert (first.tensors[1].untyped_storage().data_ptr() == address) == handed


@pytest.mark.usefixtures("moves")
def test_a_waiting_rank_keeps_what_it_alone_holds_in_host_memory(server: Server) -> None:
    """While a spliced rank waits at a collective, what it alone holds moves to host memory
    (collectives.py): counted off the device, never matched by the dedup, read there by the
    all-reduce that it waits for, and brought back bit for bit by the next operation that uses
    it; a storage freed meanwhile leaves the counts right."""
    first, second = open_sessions(server, 2)
    floats = SWAP_MIN_BYTES // 4
    nbytes = floats * 4
    for session in (first, second):
        session.add(1, torch.full((floats,), float(session.rank + 1)))  # the bucket it all-reduces
        session.add(2, torch.arange(floats, dtype=torch.float32) * (session.rank + 1))
        session.add(3, torch.zeros(floats))
    before = server.memory.used
    server.collectives._move_off(first, {"tensors": [first.tensors[1]]}, "allreduce")
    assert server.memory.used == before - 3 * nbytes
    assert server.memory.swapped_bytes == 3 * nbytes
    assert first.tensors[2].untyped_storage().nbytes() == 0, "its device memory was given back"

    server.dedup.share_job(JOB)  # second's zeros are not matched with first's, held on the host
    assert not server.memory.shared

    members = (first, second)
    instance = Instance(
        JOB,
        "group",
        0,
        members=[0, 1],
        placement=[0, 0],
        locals={s.rank: {"tensors": [s.tensors[1]], "op": "sum", "factor": 1.0, "root": 0} for s in members},
        sessions={s.rank: s for s in members},
    )
    allreduce(Exchange(server.collectives, instance, runner=None))  # type: ignore[arg-type]
    assert torch.equal(first.tensors[1], torch.full((floats,), 3.0))
    assert second.tensors[1].untyped_storage()._cdata == first.tensors[1].untyped_storage()._cdata
    assert server.memory.swapped_bytes == 2 * nbytes, "the result came back; the rest waits"

    first.free(3)
    assert server.memory.swapped_bytes == nbytes
    ops: list[list[object]] = [
        [protocol.OP_DEFINE, 1, "aten", "add_", "Tensor"],
        [protocol.OP_CALL, 1, 100, [handle(2), handle(2)], {}],
    ]
    run(server, first, ops)
    assert torch.equal(first.tensors[2], torch.arange(floats, dtype=torch.float32) * 2)
    assert server.memory.swapped_bytes == 0 and not first.swapped
    assert server.memory.used == before - 2 * nbytes  # first's bucket shared, its zeros freed


def rank_0_loaded_from(path: Path) -> torch.Tensor:
    """Rank 0's tensor 1 as a save at `path` loads on another device."""
    loaded_on = Server(1, 1 << 30, None)
    try:
        load_job(loaded_on, path)
        loaded = next(s for s in loaded_on.job_sessions(JOB) if s.rank == 0)
        return loaded.tensors[1].clone()
    finally:
        for session in loaded_on.job_sessions(JOB):
            loaded_on.drop(session)


@pytest.mark.usefixtures("moves")
def test_a_save_brings_back_what_a_waiting_rank_moved_to_host_memory(server: Server, tmp_path: Path) -> None:
    """A checkpoint taken while a rank waits with its storages in host memory saves their bytes:
    loaded on another device, the rank holds what it held."""
    first, second = open_sessions(server, 2)
    floats = SWAP_MIN_BYTES // 4
    held = torch.randn(floats, generator=torch.Generator().manual_seed(9))
    first.add(1, held.clone())
    first.parked = second.parked = True
    server.collectives._move_off(first, {}, "barrier")
    assert first.swapped, "moved to host memory"
    path = tmp_path / "state"
    save_job(server, path)
    assert rank_0_loaded_from(path).view(torch.int32).equal(held.view(torch.int32))


@pytest.mark.usefixtures("moves")
def test_an_operation_that_overwrites_a_waiting_storage_brings_it_back_without_its_old_bytes(
    server: Server,
) -> None:
    """`copy_` or `fill_` into the whole of a storage moved to host memory brings it back without
    copying its old bytes (DDP copies the all-reduced bucket into each gradient); into part of
    one, the rest comes back as it was."""
    first, _second = open_sessions(server, 2)
    floats = SWAP_MIN_BYTES // 4
    first.add(1, torch.full((floats,), 5.0))
    first.add(2, torch.arange(floats, dtype=torch.float32))
    first.add(3, torch.full((floats,), 7.0))
    first.add(4, first.tensors[3][: floats // 2])
    first.add(5, torch.full((floats,), 9.0))
    first.add(6, torch.ones(floats // 2))  # below the size moved off
    server.collectives._move_off(first, {}, "barrier")
    assert set(first.swapped) == {first.tensors[h].untyped_storage()._cdata for h in (1, 2, 3, 5)}
    brought: list[tuple[int, bool]] = []
    swap_in = first.swap_in

    def noting(key: int, keep_bytes: bool = True) -> None:
        brought.append((key, keep_bytes))
        swap_in(key, keep_bytes)

    first.swap_in = noting  # type: ignore[method-assign]
    ops: list[list[object]] = [
        [protocol.OP_DEFINE, 1, "aten", "copy_", "default"],
        [protocol.OP_DEFINE, 2, "aten", "fill_", "Scalar"],
        [protocol.OP_CALL, 1, 100, [handle(1), handle(2)], {}],
        [protocol.OP_CALL, 1, 101, [handle(4), handle(6)], {}],
        [protocol.OP_CALL, 2, 102, [handle(5), 3.0], {}],
    ]
    run(server, first, ops)
    key = {h: first.tensors[h].untyped_storage()._cdata for h in (1, 2, 3, 5)}
    assert (key[1], False) in brought and (key[5], False) in brought
    assert (key[3], True) in brought and (key[2], True) in brought
    assert torch.equal(first.tensors[1], torch.arange(floats, dtype=torch.float32))
    assert torch.equal(first.tensors[3][floats // 2 :], torch.full((floats - floats // 2,), 7.0))
    assert torch.equal(first.tensors[3][: floats // 2], torch.ones(floats // 2))
    assert torch.equal(first.tensors[5], torch.full((floats,), 3.0))
    assert not first.swapped and server.memory.swapped_bytes == 0


@pytest.mark.usefixtures("moves")
def test_a_pre_copy_meanwhile_a_rank_moves_its_storage_off_saves_its_bytes(
    server: Server, saves: Snapshots, state_fd: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spliced rank that comes to wait while a checkpoint's pre-copy runs moves its storages to
    host memory and back (the pre-copy works beside the job's operations): the saved file still
    holds the bytes the rank held, not an empty or freed storage's."""
    first, second = open_sessions(server, 2)
    floats = SWAP_MIN_BYTES // 4
    held = torch.randn(floats, generator=torch.Generator().manual_seed(5))
    first.add(1, held.clone())
    second.add(1, torch.randn(floats, generator=torch.Generator().manual_seed(6)))
    read = storage_bytes

    def rank_waits_meanwhile(storage: torch.UntypedStorage) -> torch.Tensor:
        server.collectives._move_off(first, {}, "barrier")  # as the rank's collective thread would
        flat = read(storage)
        first.swap_in_all()
        return flat

    monkeypatch.setattr(snapshot_module, "storage_bytes", rank_waits_meanwhile)
    saves.prepare(JOB, state_fd, rounds=2, budget_s=30.0, stage=False)
    monkeypatch.setattr(snapshot_module, "storage_bytes", read)
    first.parked = second.parked = True
    saves.capture(JOB, copy=True)
    saves.finish(JOB, 30.0)
    assert rank_0_loaded_from(tmp_path / "state").view(torch.int32).equal(held.view(torch.int32))


def test_a_pre_copy_keeps_what_it_reads_on_the_device_for_its_round_only(
    server: Server, saves: Snapshots, state_fd: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a pre-copy round writes its storages none of them may move to host memory (a rank
    that comes to wait keeps them on the device); once the round is over nothing is kept.
    (Letting each go as soon as it was written, under the device lock taken whenever free, made a
    running program stall up to 0.2 s more during the pre-copy: tests/test_pause.py.)"""
    first, _second = open_sessions(server, 2)
    floats = SWAP_MIN_BYTES // 4
    for handle_number, count in ((1, 3 * floats), (2, 2 * floats), (3, floats)):  # written biggest first
        first.add(handle_number, torch.randn(count, generator=torch.Generator().manual_seed(handle_number)))
    keys = [first.tensors[h].untyped_storage()._cdata for h in (1, 2, 3)]
    kept_at_each_read: list[list[bool]] = []

    def noting(storage: torch.UntypedStorage) -> torch.Tensor:
        kept_at_each_read.append([bool(server.memory.being_read[key]) for key in keys])
        return storage_bytes(storage)

    monkeypatch.setattr(snapshot_module, "storage_bytes", noting)
    saves.prepare(JOB, state_fd, rounds=1, budget_s=30.0, stage=False)
    saves.abort(JOB)
    assert kept_at_each_read == [[True, True, True]] * 3
    assert not server.memory.being_read


def test_a_save_whose_file_is_not_written_in_time_stops_writing_before_the_job_goes_on(
    server: Server, saves: Snapshots, state_fd: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the daemon gives up waiting for a preemption's file (it then lets the job run again),
    the writer that reads the job's storages from the device has stopped by the time it hears so."""
    first, second = open_sessions(server, 2)
    first.add(1, torch.randn(SWAP_MIN_BYTES // 4, generator=torch.Generator().manual_seed(1)))

    def slow_write(save: snapshot_module.JobSave, *_args: object) -> None:
        while not save.cancelled.wait(0.01):
            pass  # a write that takes longer than the daemon waits

    monkeypatch.setattr(snapshot_module.JobSave, "_write_rest", slow_write)
    first.parked = second.parked = True
    saves.prepare(JOB, state_fd, rounds=0, budget_s=0.0, stage=False)
    save = saves.saves[JOB]
    saves.capture(JOB, copy=False)
    with pytest.raises(TimeoutError):
        saves.finish(JOB, 0.05)
    assert save.writer is not None and not save.writer.is_alive()
    assert JOB not in saves.saves
