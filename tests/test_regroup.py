"""Splicing's device mapping and the regrouping of a checkpoint's device-state files (unit tests).

The files are written with the proxy server's own writer and read back with its own reader, so
a regrouped file is proven to load into a server with every tensor's bytes and layout intact.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from proxy.server import statefile
from singularityd.devices import regroup
from singularityd.devices.regroup import RegroupError
from singularityd.devices.splicing import device_slots, logical_devices, spliced


def test_logical_devices_and_slots() -> None:
    """A job sees max(ranks, gpus) devices; servers take contiguous blocks of them."""
    assert logical_devices(4, 1) == 4
    assert logical_devices(1, 2) == 2
    assert device_slots(4, 4) == [0, 1, 2, 3]
    assert device_slots(4, 2) == [0, 0, 1, 1]
    assert device_slots(4, 1) == [0, 0, 0, 0]
    assert device_slots(4, 3) == [0, 0, 1, 2]
    assert spliced(4, 2) and not spliced(4, 4)
    with pytest.raises(ValueError):
        device_slots(2, 3)


def test_format_constants_match_the_server() -> None:
    """The regrouper writes the format the proxy server reads."""
    assert regroup.FILE_MAGIC == statefile.FILE_MAGIC
    assert regroup.INDEX_MAGIC == statefile.INDEX_MAGIC
    assert regroup.TRAILER.format == statefile.TRAILER.format
    assert regroup.ALIGN == statefile.ALIGN
    assert regroup.FORMAT == statefile.FORMAT


def write_state(
    path: Path, slot: int, sessions: dict[int, dict[int, torch.Tensor]], logical: dict[int, int] | None = None
) -> None:
    """A device-state file of `sessions` ({rank: {handle: tensor}}, each with a plans blob), as a
    server writes it: tensors sharing a storage name one storage record. Rank r's session is of
    logical device cuda:r unless `logical` says otherwise."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        writer = statefile.StateFileWriter(fd)
        storages: dict[str, list[int]] = {}
        blobs: dict[str, list[int]] = {}
        ids: dict[int, int] = {}
        entries: list[dict[str, Any]] = []
        served = logical or {}
        for rank, tensors in sessions.items():
            table = {}
            for handle, tensor in tensors.items():
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in ids:
                    ids[storage.data_ptr()] = len(ids)
                    flat = statefile.storage_bytes(storage)
                    storages[str(len(ids) - 1)] = [writer.append_bytes(flat), flat.numel()]
                table[str(handle)] = statefile.tensor_entry(tensor, ids[storage.data_ptr()])
            plans = statefile.blob_of({rank: ["plan"]})
            blobs[str(rank)] = [writer.append(plans), len(plans)]
            entries.append(
                {
                    "job_id": "7", "rank": rank, "index": served.get(rank, rank), "uid": 0, "ops": {},
                    "peak": 0, "pending_error": None, "plans": rank, "queue": None, "groups": {},
                    "tensors": table,
                }
            )  # fmt: skip
        index = {"format": statefile.FORMAT, "device": slot, "storages": storages, "blobs": blobs}
        writer.finish({**index, "sessions": entries})
    finally:
        os.close(fd)


def read(path: Path) -> dict[int, statefile.SavedSession]:
    """The sessions of a device-state file by rank, read by the server's reader."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return {s.rank: s for s in statefile.read_state(fd, torch.device("cpu"))[1]}
    finally:
        os.close(fd)


def test_regroup_splits_and_merges_by_session(tmp_path: Path) -> None:
    """4 ranks on 2 files become 3 files and back: every tensor, view and plan is intact."""
    weights = {r: torch.arange(1000, dtype=torch.float32) * (r + 1) for r in range(4)}
    views = {r: weights[r][10:20].view(2, 5) for r in range(4)}
    old = [tmp_path / "cuda0.state", tmp_path / "cuda1.state"]
    write_state(old[0], 0, {0: {1: weights[0], 2: views[0]}, 1: {1: weights[1], 2: views[1]}})
    write_state(old[1], 1, {2: {1: weights[2], 2: views[2]}, 3: {1: weights[3], 2: views[3]}})
    three = regroup.regroup(old, device_slots(4, 3), 3, tmp_path / "three")
    placed = {slot: sorted(read(path)) for slot, path in enumerate(three) if path is not None}
    assert placed == {0: [0, 1], 1: [2], 2: [3]}
    back = regroup.regroup(three, device_slots(4, 1), 1, tmp_path / "one")
    assert back[0] is not None
    sessions = read(back[0])
    assert sorted(sessions) == [0, 1, 2, 3]
    for rank, session in sessions.items():
        assert torch.equal(session.tensors[1], weights[rank])
        assert torch.equal(session.tensors[2], views[rank])
        assert (
            session.tensors[2].untyped_storage().data_ptr() == session.tensors[1].untyped_storage().data_ptr()
        )
        assert session.plans == {rank: ["plan"]}


def test_an_unfinished_file_is_refused(tmp_path: Path) -> None:
    """A file without its index is not regrouped into garbage."""
    broken = tmp_path / "cuda0.state"
    broken.write_bytes(regroup.FILE_MAGIC + b"\0" * 100)
    with pytest.raises(RegroupError, match="no index"):
        regroup.regroup([broken], [0], 1, tmp_path / "out")


def placed(files: list[Path | None]) -> dict[int, list[int]]:
    """The ranks of the sessions in each regrouped file, by slot."""
    return {slot: sorted(read(path)) for slot, path in enumerate(files) if path is not None}


def test_each_session_goes_where_its_logical_device_is_served(tmp_path: Path) -> None:
    """Whether or not a process will reconnect to it (a rank that ended before the checkpoint with
    work left keeps its session), each session moves to the slot serving its logical device."""
    old = [tmp_path / f"cuda{slot}.state" for slot in range(4)]
    for rank, path in enumerate(old):
        write_state(path, rank, {rank: {1: torch.full((8,), float(rank))}})
    two = regroup.regroup(old, device_slots(4, 2), 2, tmp_path / "two")
    assert placed(two) == {0: [0, 1], 1: [2, 3]}
    three = regroup.regroup(two, device_slots(4, 3), 3, tmp_path / "three")
    assert placed(three) == {0: [0, 1], 1: [2], 2: [3]}


def test_two_devices_of_one_rank_may_share_a_slot(tmp_path: Path) -> None:
    """A rank using cuda:0 and cuda:1 keeps a session for each, wherever they are served."""
    old = [tmp_path / "cuda0.state", tmp_path / "cuda1.state"]
    write_state(old[0], 0, {0: {1: torch.zeros(4)}}, logical={0: 0})
    write_state(old[1], 1, {0: {1: torch.ones(4)}}, logical={0: 1})
    one = regroup.regroup(old, device_slots(2, 1), 1, tmp_path / "one")
    assert one[0] is not None and len(regroup.read_index(one[0]).index["sessions"]) == 2
    back = regroup.regroup(one, device_slots(2, 2), 2, tmp_path / "two")
    assert [regroup.read_index(path).index["sessions"][0]["index"] for path in back if path] == [0, 1]


def test_a_session_beyond_the_jobs_devices_is_refused(tmp_path: Path) -> None:
    """A session of a logical device the job does not have cannot be placed."""
    path = tmp_path / "cuda0.state"
    write_state(path, 0, {0: {1: torch.zeros(4)}}, logical={0: 5})
    with pytest.raises(RegroupError, match="cuda:5, beyond the job's 2 devices"):
        regroup.regroup([path], device_slots(2, 1), 1, tmp_path / "out")
