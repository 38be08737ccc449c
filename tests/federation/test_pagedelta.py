"""A file sent as its changes against a base: the transform alone, on real files."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from singularityd.checkpoint.manifest import FileRecord, Manifest, digest_problems
from singularityd.federation import pagedelta
from singularityd.federation.pagedelta import (
    BLOCK_BYTES,
    BaseIndex,
    DeltaError,
    apply_recipe,
    index_base,
    make_recipe,
    plan_runs,
    read_recipe,
)
from tests.helpers import invert_bytes

BS = BLOCK_BYTES


def blocks(*parts: bytes) -> bytes:
    """Whole blocks, each filled with one byte value (b"ab" -> two blocks)."""
    return b"".join(bytes([value]) * BS for part in parts for value in part)


def round_trip(tmp_path: Path, base: dict[str, bytes], new: bytes) -> tuple[bytes, int]:
    """Rebuild `new` through a recipe against `base`; the rebuilt bytes and the literal bytes."""
    root = tmp_path / "root"
    for name, data in base.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    index = index_base(root, sorted(base))
    image, recipe, literals, output = (tmp_path / n for n in ("new.img", "new.recipe", "new.lit", "out.img"))
    image.write_bytes(new)
    figures = make_recipe(image, index, recipe, literals)
    assert figures.size == len(new)
    assert literals.stat().st_size == figures.literal_bytes
    assert apply_recipe(recipe, literals, root, output) == (len(new), hashlib.sha256(new).hexdigest())
    return output.read_bytes(), figures.literal_bytes


def test_a_file_made_of_moved_base_blocks_travels_as_a_small_recipe(tmp_path: Path) -> None:
    base = os.urandom(64 * BS)
    new = base[10 * BS : 40 * BS] + os.urandom(3 * BS) + base[: 10 * BS] + base[50 * BS :] + b"tail!"
    rebuilt, literal = round_trip(tmp_path, {"base/pages-1.img": base}, new)
    assert rebuilt == new
    assert literal == 3 * BS + 5
    _, runs = read_recipe(tmp_path / "new.recipe")
    assert len(runs) == 5  # three copied runs, one literal run, the tail
    assert (tmp_path / "new.recipe").stat().st_size < 1000


def test_a_rebuild_over_a_draft_of_the_base_writes_only_what_moved_and_hashes_the_file(
    tmp_path: Path,
) -> None:
    """A draft (a copy of the same-named base file) becomes the output: the runs the base holds at
    the same offset are left as they are, the rest written over it, the file cut to its size; the
    digest is of the file as it ends up, so a draft that differs from the base fails the manifest
    (or none, for a caller that hashes the file itself later)."""
    base = os.urandom(64 * BS)
    new = base[: 20 * BS] + os.urandom(2 * BS) + base[22 * BS : 40 * BS] + base[: 5 * BS] + b"tail"
    root = tmp_path / "root"
    (root / "base").mkdir(parents=True)
    (root / "base/pages-1.img").write_bytes(base)
    image, recipe, literals = (tmp_path / n for n in ("pages-1.img", "new.recipe", "new.lit"))
    image.write_bytes(new)
    make_recipe(image, index_base(root, ["base/pages-1.img"]), recipe, literals)
    wanted = (len(new), hashlib.sha256(new).hexdigest())
    for case in ("same", "bad in place", "bad elsewhere", "other name", "unhashed"):
        draft = tmp_path / "draft" / ("pages-2.img" if case == "other name" else "pages-1.img")
        draft.parent.mkdir(exist_ok=True)
        draft.write_bytes(base)
        if case.startswith("bad"):
            invert_bytes(draft, (3 if case == "bad in place" else 50) * BS, 8)
        output = tmp_path / "out" / "pages-1.img"
        output.parent.mkdir(exist_ok=True)
        hash_as_written = case != "unhashed"
        got = apply_recipe(recipe, literals, root, output, draft, hash_as_written=hash_as_written)
        if case != "bad in place":
            assert output.read_bytes() == new
        assert output.stat().st_size == len(new)
        if hash_as_written:
            assert (got == wanted) == (case != "bad in place"), case
            assert got == (len(new), hashlib.sha256(output.read_bytes()).hexdigest())
        else:
            assert got == (len(new), None), "the caller hashes the file later"
        assert draft.exists() == (case == "other name")


def test_blocks_that_follow_in_the_base_are_compared_not_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An image like the same-named base image but for a block changed in place, a block inserted
    (the rest shifted by one) and a block that moved: only the blocks where the order breaks are
    hashed (5 of 601), the others found by comparison, and the recipe rebuilds it exactly."""
    root = tmp_path / "root"
    (root / "base").mkdir(parents=True)
    base = os.urandom(600 * BS)  # more than one read of READ_BYTES
    (root / "base" / "pages-1.img").write_bytes(base)
    index = index_base(root, ["base/pages-1.img"])
    changed, inserted = os.urandom(BS), os.urandom(BS)
    new = (
        base[: 5 * BS] + changed + base[6 * BS : 300 * BS] + inserted
        + base[300 * BS : 520 * BS] + base[40 * BS : 41 * BS] + base[521 * BS :] + b"tail"
    )  # fmt: skip
    image = tmp_path / "images" / "pages-1.img"
    image.parent.mkdir()
    image.write_bytes(new)
    hashed: list[int] = []
    real = pagedelta._digest

    def counted(block: bytes | memoryview) -> bytes:
        hashed.append(len(block))
        return real(block)

    monkeypatch.setattr(pagedelta, "_digest", counted)
    recipe, literals, output = tmp_path / "r", tmp_path / "l", tmp_path / "out.img"
    figures = make_recipe(image, index, recipe, literals, root)
    assert len(hashed) == 5  # changed; inserted, then the shifted one; moved, then the one after
    assert figures.literal_bytes == 2 * BS + 4
    assert apply_recipe(recipe, literals, root, output)[0] == len(new)
    assert output.read_bytes() == new

    hashed.clear()
    make_recipe(image, index, recipe, literals)  # without the base's files: every block hashed
    assert len(hashed) == 601
    assert apply_recipe(recipe, literals, root, output)[0] == len(new)
    assert output.read_bytes() == new


def test_runs_join_consecutive_base_blocks_and_literals() -> None:
    index = index_base_of_digests([b"a", b"b", b"c"])
    assert plan_runs([b"a", b"b", b"c", b"x", b"y", b"b", b"c", b"a"], index) == [
        (0, 0, 3),
        (-1, 0, 2),
        (0, 1, 2),
        (0, 0, 1),
    ]


def index_base_of_digests(digests: list[bytes]) -> BaseIndex:
    """A base index of one file whose blocks have these (fake) digests."""
    return BaseIndex(("base/x",), BS, {d: (0, n) for n, d in enumerate(digests)})


def test_blocks_are_found_in_any_base_file(tmp_path: Path) -> None:
    one, two = os.urandom(8 * BS), os.urandom(8 * BS)
    new = two[2 * BS : 4 * BS] + one[5 * BS :] + two[:BS]
    rebuilt, literal = round_trip(tmp_path, {"base/pages-1.img": one, "base/pages-2.img": two}, new)
    assert rebuilt == new and literal == 0


def test_without_a_common_block_everything_is_literal(tmp_path: Path) -> None:
    new = os.urandom(5 * BS + 100)
    rebuilt, literal = round_trip(tmp_path, {"base/pages-1.img": os.urandom(5 * BS)}, new)
    assert rebuilt == new and literal == len(new)


@pytest.mark.parametrize("new", [b"", b"short", blocks(b"a")], ids=["empty", "under-a-block", "one-block"])
def test_zero_length_and_tiny_files_and_an_empty_base(tmp_path: Path, new: bytes) -> None:
    for base in (b"", blocks(b"ab")):
        rebuilt, _ = round_trip(tmp_path / str(len(base)), {"base/pages-1.img": base}, new)
        assert rebuilt == new


def made(tmp_path: Path) -> tuple[Path, Path, Path, bytes]:
    """A file mostly of blocks of base/pages-1.img, and its recipe: root, recipe, literals, file."""
    root = tmp_path / "root"
    (root / "base").mkdir(parents=True)
    base = os.urandom(16 * BS)
    (root / "base" / "pages-1.img").write_bytes(base)
    new = base[4 * BS :] + os.urandom(2 * BS)
    (tmp_path / "new.img").write_bytes(new)
    make_recipe(tmp_path / "new.img", index_base(root, ["base/pages-1.img"]), tmp_path / "r", tmp_path / "l")
    return root, tmp_path / "r", tmp_path / "l", new


def test_a_base_missing_blocks_or_files_fails_the_rebuild(tmp_path: Path) -> None:
    root, recipe, literals, _ = made(tmp_path)
    out = tmp_path / "out"
    with open(root / "base" / "pages-1.img", "r+b") as handle:
        handle.truncate(10 * BS)
    with pytest.raises(DeltaError, match="lacks blocks"):
        apply_recipe(recipe, literals, root, out)
    assert not out.exists()
    (root / "base" / "pages-1.img").unlink()
    with pytest.raises(DeltaError, match="missing"):
        apply_recipe(recipe, literals, root, out)


def test_a_corrupt_literal_is_caught_by_the_manifest_check_and_a_short_one_at_once(tmp_path: Path) -> None:
    root, recipe, literals, new = made(tmp_path)
    files = {"out": FileRecord(len(new), hashlib.sha256(new).hexdigest())}
    manifest = Manifest("1", 1, 0.0, 0, leave_running=False, criu_version="4.2", files=files)
    out = tmp_path / "out"
    data = bytearray(literals.read_bytes())
    data[7] ^= 0xFF
    literals.write_bytes(bytes(data))
    _, written = apply_recipe(recipe, literals, root, out)
    assert written == hashlib.sha256(out.read_bytes()).hexdigest()
    assert digest_problems(manifest, {"out": written}) == ["out fails its sha256 check"]
    literals.write_bytes(bytes(data[:-1]))
    with pytest.raises(DeltaError, match="ended"):
        apply_recipe(recipe, literals, root, out)
    literals.write_bytes(bytes(data) + b"x")
    with pytest.raises(DeltaError, match="more than its recipe uses"):
        apply_recipe(recipe, literals, root, out)


def test_a_malformed_recipe_is_refused_with_one_line(tmp_path: Path) -> None:
    root, recipe, literals, _ = made(tmp_path)
    header, _, body = recipe.read_bytes().partition(b"\n")
    for bad, why in [
        (b"not json\n" + body, "header"),
        (header + b"\n" + body[:-3], "truncated"),
        (header.replace(b'"base/pages-1.img"', b'"../../etc/passwd"') + b"\n" + body, "outside"),
        (header + b"\n" + body + body, "longer|bytes, not"),
    ]:
        recipe.write_bytes(bad)
        with pytest.raises(DeltaError, match=why):
            apply_recipe(recipe, literals, root, tmp_path / "out")
