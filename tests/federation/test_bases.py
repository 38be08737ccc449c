"""Process images sent as changes against a base: staging, the chunked transfer, the rebuild.

The base here is written by the test (no CRIU: a real two-daemon move is in test_lab.py); the
transfer is the real one, in process (transfer.copy_locally).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from singularityd.federation import bases, pagedelta
from singularityd.federation.pagedelta import BLOCK_BYTES, DeltaError, DeltaFigures, index_base
from singularityd.federation.transfer import Destination, MiB, Source, copy_locally, missing

BS = BLOCK_BYTES
IMAGE = "checkpoint/7/images/pages-1.img"


def make_base(folder: Path, size: int) -> tuple[bases.ProcessBase, bytes]:
    """A base of one pages image of random bytes under `folder`."""
    (folder / bases.BASE_DIR).mkdir(parents=True)
    data = os.urandom(size)
    (folder / bases.BASE_DIR / "pages-1.img").write_bytes(data)
    names = [f"{bases.BASE_DIR}/pages-1.img"]
    return bases.ProcessBase(folder, index_base(folder, names), 0.0), data


def make_staging(staging: Path, image: bytes) -> None:
    """A directory to send: a checkpoint with one pages image, a small image and a record."""
    (staging / IMAGE).parent.mkdir(parents=True)
    (staging / IMAGE).write_bytes(image)
    (staging / IMAGE).chmod(0o600)
    (staging / "checkpoint/7/images/core-1.img").write_bytes(b"core")
    (staging / "checkpoint/7/images/pages-2.img").write_bytes(os.urandom(3 * BS))  # under 1 MiB
    (staging / "job.json").write_text("{}")


def send(staging: Path, incoming: Path) -> int:
    """Move `staging` to `incoming` with the real protocol; the bytes sent."""
    sent: list[int] = [0]
    problems = copy_locally(
        Source(staging, MiB),
        Destination(incoming, Source(staging, MiB).entries, MiB),
        lambda p: sent.append(p.sent),
    )
    assert problems == []
    return max(sent)


def seed(staging: Path, incoming: Path) -> int:
    """Send `staging` to `incoming` without finishing, as the pre-send does; the bytes sent."""
    source = Source(staging, MiB)
    destination = Destination(incoming, source.entries, MiB)
    sent = 0
    for key in missing(source, destination.held):
        destination.put(key, *source.read(key))
        sent += source.chunks[key][1]
    destination.close()
    return sent


def test_images_travel_as_changes_and_are_rebuilt_exactly(tmp_path: Path) -> None:
    base, old = make_base(tmp_path / "base-dump", 4 * MiB)
    image = old[MiB : 3 * MiB] + os.urandom(8 * BS) + old[: MiB // 2] + b"odd tail"
    staging, incoming = tmp_path / "staging", tmp_path / "incoming"
    make_staging(staging, image)
    pre = tmp_path / "pre"
    bases.stage_base(pre, base)
    assert seed(pre, incoming) == 4 * MiB  # while the job runs: the base
    summary = bases.stage_deltas(staging, base)
    assert (summary.images, summary.image_bytes) == (1, len(image))
    assert summary.literal_bytes == 8 * BS + len(b"odd tail")
    assert not (staging / IMAGE).exists()
    assert bases.draft_images(incoming) == 4 * MiB and bases.drafts_ready(incoming) == 1  # still running
    sent = send(staging, incoming)  # after the stop: only what the base lacks
    assert sent < 16 * BS + 5000, sent
    assert bases.rebuild_deltas(incoming) == {IMAGE: hashlib.sha256(image).hexdigest()}
    assert (incoming / IMAGE).read_bytes() == image
    assert (incoming / IMAGE).stat().st_mode & 0o777 == 0o600
    assert not any((incoming / d).exists() for d in (bases.DELTA_DIR, bases.BASE_DIR, bases.DRAFT_DIR))
    assert (incoming / "checkpoint/7/images/pages-2.img").stat().st_size == 3 * BS


def test_a_target_without_the_base_gets_it_in_the_final_transfer(tmp_path: Path) -> None:
    base, old = make_base(tmp_path / "base-dump", 2 * MiB)
    image = old[::-1][:MiB] + old[MiB:]
    staging, incoming = tmp_path / "staging", tmp_path / "incoming"
    make_staging(staging, image)
    bases.stage_deltas(staging, base)
    assert send(staging, incoming) >= 2 * MiB  # the base went along: it only cost time
    bases.rebuild_deltas(incoming)
    assert (incoming / IMAGE).read_bytes() == image


def test_without_large_images_nothing_changes_and_a_broken_base_fails_the_rebuild(tmp_path: Path) -> None:
    base, old = make_base(tmp_path / "base-dump", 2 * MiB)
    small = tmp_path / "small"
    (small / "checkpoint/7/images").mkdir(parents=True)
    (small / "checkpoint/7/images/pages-1.img").write_bytes(old[: 4 * BS])
    assert bases.stage_deltas(small, base) == bases.DeltaSummary()
    assert not (small / bases.BASE_DIR).exists()
    assert bases.rebuild_deltas(small) == {}
    staging, incoming = tmp_path / "staging", tmp_path / "incoming"
    make_staging(staging, old[MiB:] + old[:MiB])
    bases.stage_deltas(staging, base)
    send(staging, incoming)
    (incoming / bases.BASE_DIR / "pages-1.img").unlink()
    with pytest.raises(DeltaError, match="missing"):
        bases.rebuild_deltas(incoming)
    assert (incoming / bases.DELTA_DIR).is_dir()  # kept: nothing is dropped on failure


def test_recipes_made_once_dumped_are_taken_only_for_the_same_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recipes a move begins as soon as CRIU has written the final dump are taken by the
    staging when its image is that very file (a hard link); another file gets its recipe made
    then. Either way the target rebuilds the image exactly."""
    base, old = make_base(tmp_path / "base-dump", 4 * MiB)
    image = old[MiB:] + os.urandom(8 * BS)
    dumped = tmp_path / "dumped"
    dumped.mkdir()
    (dumped / "pages-1.img").write_bytes(image)
    early = bases.early_deltas(dumped, base, tmp_path / "early")
    assert set(early) == {"pages-1.img"} and early["pages-1.img"].figures.literal_bytes == 8 * BS
    made: list[Path] = []
    real_make_recipe = pagedelta.make_recipe

    def make_recipe(path: Path, *args: Any) -> DeltaFigures:
        made.append(path)
        return real_make_recipe(path, *args)

    monkeypatch.setattr(bases, "make_recipe", make_recipe)
    for case in ("another file", "the same file"):
        staging, incoming = tmp_path / f"staging {case}", tmp_path / f"incoming {case}"
        make_staging(staging, image)
        if case == "the same file":
            (staging / IMAGE).unlink()
            os.link(dumped / "pages-1.img", staging / IMAGE)
        made.clear()
        summary = bases.stage_deltas(staging, base, early)
        assert (summary.images, summary.literal_bytes) == (1, 8 * BS)
        assert made == ([] if case == "the same file" else [staging / IMAGE]), case
        send(staging, incoming)
        bases.rebuild_deltas(incoming)
        assert (incoming / IMAGE).read_bytes() == image, case
