"""A large file sent as its changes against a base the receiver holds: blocks found by content.

CRIU cannot pre-dump on a kernel without memory dirty tracking, so a move would send a job's whole
process images (pages-*.img) while it is stopped. Most of their blocks are already in an earlier
in-place dump of the same job (a *base*, sent while the job ran), mostly in the same order in the
base's image of the same name, shifted where pages came or went. The sender cuts the new image
into blocks and compares each with the base block after the last one found; only a block that
differs is hashed and looked up by its sha256 among the base's blocks. The sender writes a
*recipe* (runs of blocks copied from the base, by file and block number, or taken in order from
the literals) and the *literals* (the blocks the base lacks). The receiver rebuilds the exact file
from its copy of the base and the literals. The rebuild does not trust itself: the sha256 of the
rebuilt file (hashed as it is written, or afterwards beside CRIU's frozen restore) is checked like
any other file's against the checkpoint's manifest before the job runs, so a base that differs from
the sender's, or a corrupt literal, fails that check instead of running.

Recipe file: one JSON line (format, block size, output size, base file names), then the runs as
little-endian int64 triples (base file index or -1 for literals, first block, block count).
Blocking file I/O throughout: call it from a thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

BLOCK_BYTES = 4096
FORMAT = 1
LITERAL = -1
RUN = struct.Struct("<qqq")
READ_BYTES = 8 << 20
HASH_THREADS = 2
SPAN_BLOCKS = 64
"""The most blocks compared in one piece while the image follows the base (spans double up to it
and start again at one after a difference)."""


class DeltaError(ValueError):
    """A recipe that cannot be applied (or made); the message (one line) says why."""


@dataclass(frozen=True)
class BaseIndex:
    """The blocks of a base: where (file index, block number) to find each block by its sha256."""

    names: tuple[str, ...]
    """The base's files, as the receiver names them (paths relative to the transfer's root)."""
    block_bytes: int
    blocks: dict[bytes, tuple[int, int]]


@dataclass(frozen=True)
class DeltaFigures:
    """What one file's recipe holds: its size, and how many of its bytes travel as literals."""

    size: int
    literal_bytes: int
    recipe_bytes: int


def _block_digests(path: Path, block_bytes: int, start: int, stop: int) -> list[bytes]:
    """sha256 of the whole blocks of `path` from block `start` to `stop` (excluded)."""
    digests: list[bytes] = []
    with open(path, "rb", buffering=0) as handle:
        handle.seek(start * block_bytes)
        left = (stop - start) * block_bytes
        while left > 0:
            data = handle.read(min(READ_BYTES, left))
            if not data:
                break
            view = memoryview(data)
            whole = len(data) - len(data) % block_bytes
            digests.extend(_digest(view[i : i + block_bytes]) for i in range(0, whole, block_bytes))
            left -= len(data)
    return digests


def block_digests(path: Path, block_bytes: int = BLOCK_BYTES) -> list[bytes]:
    """The sha256 of every whole block of a file, in order (hashed on a few threads)."""
    count = path.stat().st_size // block_bytes
    step = max(1, -(-count // HASH_THREADS))
    spans = [(start, min(count, start + step)) for start in range(0, count, step)]
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        parts = pool.map(lambda span: _block_digests(path, block_bytes, *span), spans)
        return [d for part in parts for d in part]


def index_base(root: Path, names: Sequence[str], block_bytes: int = BLOCK_BYTES) -> BaseIndex:
    """Index the whole blocks of the base files `names` (relative to `root`) by content."""
    blocks: dict[bytes, tuple[int, int]] = {}
    for file_index, name in enumerate(names):
        for number, block_digest in enumerate(block_digests(root / name, block_bytes)):
            blocks.setdefault(block_digest, (file_index, number))
    return BaseIndex(tuple(names), block_bytes, blocks)


def _extend(runs: list[tuple[int, int, int]], file_index: int, number: int, count: int) -> None:
    """Append `count` blocks from `number` of base file `file_index` (or literals) to the runs,
    joining the last run when they follow it."""
    if runs:
        last_file, last_first, last_count = runs[-1]
        follows = file_index == LITERAL or number == last_first + last_count
        if last_file == file_index and follows:
            runs[-1] = (last_file, last_first, last_count + count)
            return
    runs.append((file_index, number if file_index != LITERAL else 0, count))


def plan_runs(digests: Sequence[bytes], base: BaseIndex) -> list[tuple[int, int, int]]:
    """Runs (base file or LITERAL, first block, count) that make a file of blocks with these digests."""
    runs: list[tuple[int, int, int]] = []
    for block_digest in digests:
        where = base.blocks.get(block_digest)
        file_index, number = where if where is not None else (LITERAL, 0)
        _extend(runs, file_index, number, 1)
    return runs


def _digest(block: bytes | memoryview) -> bytes:
    """The sha256 of one block."""
    return hashlib.sha256(block).digest()


def _same_named(path: Path, names: Sequence[str]) -> int | None:
    """The base file (of `names`) with the same name as `path` (CRIU numbers a tree's pages images
    alike), if exactly one."""
    found = [i for i, name in enumerate(names) if name.rsplit("/", 1)[-1] == path.name]
    return found[0] if len(found) == 1 else None


def _equal_blocks(theirs: int, at: int, ours: bytes, start: int, count: int, bs: int) -> int:
    """How many of `count` blocks of `ours` from `start` equal those of the file open at `theirs`
    from offset `at`, in a row from the first (a difference found by halving)."""
    other = os.pread(theirs, count * bs, at)
    if other == ours[start : start + count * bs]:
        return count
    low, high = 0, min(count - 1, len(other) // bs)  # the answer lies between the two
    while low < high:
        middle = (low + high + 1) // 2
        if other[: middle * bs] == ours[start : start + middle * bs]:
            low = middle
        else:
            high = middle - 1
    return low


def plan_runs_against(path: Path, base: BaseIndex, base_root: Path) -> list[tuple[int, int, int]]:
    """The runs of `path`'s whole blocks. Each block is first compared with the base block after
    the last one found (at the start, the first of the same-named base file): memory that stayed
    where it was, or moved in one piece, is found by comparison, in spans that double while the
    image follows the base. Only the other blocks are hashed and looked up by digest. After a block
    the base lacks, the next is expected where it would have followed (a page written in place)."""
    bs = base.block_bytes
    count = path.stat().st_size // bs
    runs: list[tuple[int, int, int]] = []
    step = max(1, READ_BYTES // bs)
    with contextlib.ExitStack() as stack:
        fds = [stack.enter_context(open(base_root / name, "rb", buffering=0)).fileno() for name in base.names]
        same = _same_named(path, base.names)
        expect = (same, 0) if same is not None else None
        mine = stack.enter_context(open(path, "rb", buffering=0))
        span = 1
        for first in range(0, count, step):
            blocks = min(step, count - first)
            ours = os.pread(mine.fileno(), blocks * bs, first * bs)
            if len(ours) != blocks * bs:
                raise DeltaError(f"{path.name} shrank while its recipe was made")
            n = 0
            while n < blocks:
                if expect is not None:
                    file_index, number = expect
                    asked = min(span, blocks - n)
                    equal = _equal_blocks(fds[file_index], number * bs, ours, n * bs, asked, bs)
                    span = min(2 * span, SPAN_BLOCKS) if equal == asked else 1
                    if equal:
                        _extend(runs, file_index, number, equal)
                        expect, n = (file_index, number + equal), n + equal
                        continue
                where = base.blocks.get(_digest(ours[n * bs : (n + 1) * bs]))
                if where is None:
                    _extend(runs, LITERAL, 0, 1)
                    if expect is not None:
                        expect = (expect[0], expect[1] + 1)
                else:
                    _extend(runs, where[0], where[1], 1)
                    expect = (where[0], where[1] + 1)
                n += 1
    return runs


def make_recipe(
    path: Path, base: BaseIndex, recipe: Path, literals: Path, base_root: Path | None = None
) -> DeltaFigures:
    """Write the recipe and literals that rebuild `path` from `base` (a partial last block is a
    literal); with `base_root` (where the base's files are), blocks where they were in the base
    are found by comparison first."""
    size = path.stat().st_size
    bs = base.block_bytes
    if base_root is None:
        runs = plan_runs(block_digests(path, bs), base)
    else:
        runs = plan_runs_against(path, base, base_root)
    literal_bytes = 0
    with open(path, "rb") as source, open(literals, "wb") as out:
        position = 0
        for file_index, _first, count in runs:
            if file_index == LITERAL:
                source.seek(position)
                _copy(source, out, count * bs)
                literal_bytes += count * bs
            position += count * bs
        tail = size - position
        if tail:
            source.seek(position)
            _copy(source, out, tail)
            literal_bytes += tail
            runs.append((LITERAL, 0, 0))  # the tail: whatever the literals hold past the blocks
    header = {"format": FORMAT, "block_bytes": bs, "size": size, "base": list(base.names)}
    body = b"".join(RUN.pack(*run) for run in runs)
    recipe.write_bytes(json.dumps(header, sort_keys=True).encode() + b"\n" + body)
    return DeltaFigures(size, literal_bytes, recipe.stat().st_size)


def _copy(source: BinaryIO, out: BinaryIO, length: int) -> None:
    """Copy `length` bytes from one open binary file to another (DeltaError if the source ends)."""
    while length > 0:
        data = source.read(min(READ_BYTES, length))
        if not data:
            raise DeltaError("a file ended before its recipe did")
        out.write(data)
        length -= len(data)


def read_recipe(recipe: Path) -> tuple[dict[str, object], list[tuple[int, int, int]]]:
    """The header and runs of a recipe file (DeltaError when it is malformed)."""
    data = recipe.read_bytes()
    line, _, body = data.partition(b"\n")
    try:
        header = json.loads(line)
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ValueError(f"format {header.get('format') if isinstance(header, dict) else header!r}")
        for key in ("block_bytes", "size"):
            if not isinstance(header.get(key), int) or header[key] < (1 if key == "block_bytes" else 0):
                raise ValueError(f"bad {key}")
        names = header.get("base")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError("bad base names")
    except ValueError as error:
        raise DeltaError(f"{recipe.name}: unreadable recipe header ({error})") from None
    if len(body) % RUN.size:
        raise DeltaError(f"{recipe.name}: truncated recipe")
    runs = [RUN.unpack_from(body, offset) for offset in range(0, len(body), RUN.size)]
    return header, runs


def _runs_in_order(
    runs: Sequence[tuple[int, int, int]], names: Sequence[str], size: int, block_bytes: int
) -> Iterator[tuple[int, int, int]]:
    """The runs, checked against the file's size and the base's names; the tail run gets its length."""
    position = 0
    for index, (file_index, first, count) in enumerate(runs):
        if file_index < LITERAL or file_index >= len(names) or first < 0 or count < 0:
            raise DeltaError(f"run {index} names no block of the base")
        length = count * block_bytes
        if (file_index, first, count) == (LITERAL, 0, 0) and index == len(runs) - 1:
            length = size - position
            if not 0 < length < block_bytes:
                raise DeltaError("the recipe's tail does not fit the file's size")
        position += length
        if position > size:
            raise DeltaError("the recipe makes a file longer than its size")
        yield file_index, first, length
    if position != size:
        raise DeltaError(f"the recipe makes {position} bytes, not {size}")


def apply_recipe(
    recipe: Path,
    literals: Path,
    base_root: Path,
    output: Path,
    draft: Path | None = None,
    *,
    hash_as_written: bool = True,
) -> tuple[int, str | None]:
    """Rebuild a file from its recipe, its literals and the base under `base_root`; its size and
    the sha256 of the file as rebuilt (hashed as it was written, so it is not read again; None
    without `hash_as_written`, for a caller that hashes the file later, beside other work).

    A `draft` (a copy of the same-named base file, made while the job still ran) becomes the
    output: it is written over, which is quicker than filling a new file, and the runs the base
    holds at the same offset are left as they are (read back and hashed, so a bad draft fails the
    manifest check like any bad file; not read at all without `hash_as_written`). DeltaError when
    the recipe is malformed, a base block it names is missing, or the literals are too short or
    too long. The content is not checked here (see the module's docstring)."""
    header, runs = read_recipe(recipe)
    size, bs = int(str(header["size"])), int(str(header["block_bytes"]))
    names = [str(n) for n in header["base"]]  # type: ignore[attr-defined]
    for name in names:
        if name.startswith("/") or ".." in name.split("/"):
            raise DeltaError(f"the recipe names a base file outside the transfer: {name!r}")
    plan = list(_runs_in_order(runs, names, size, bs))
    in_place = _same_named(draft, names) if draft is not None and draft.is_file() else None
    fds: dict[int, int] = {}
    written = hashlib.sha256() if hash_as_written else None
    try:
        if draft is not None and in_place is not None:
            os.replace(draft, output)
            out = os.open(output, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        else:
            out = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            drafted_bytes = os.fstat(out).st_size if in_place is not None else 0
            with open(literals, "rb") as taken:
                position = 0
                for file_index, first, length in plan:
                    if file_index == LITERAL:
                        _place(
                            taken.read(length),
                            length,
                            out,
                            position,
                            written,
                            "a file ended before its recipe did",
                        )
                    elif (
                        file_index == in_place
                        and first * bs == position
                        and position + length <= drafted_bytes
                    ):
                        if written is not None:  # the bytes are in place: read only to hash them
                            _place(
                                os.pread(out, length, position),
                                length,
                                None,
                                position,
                                written,
                                "the draft shrank",
                            )
                    else:
                        data = os.pread(_base_fd(fds, file_index, base_root, names), length, first * bs)
                        short = f"base file {names[file_index]} lacks blocks {first}..{first + length // bs}"
                        _place(data, length, out, position, written, short)
                    position += length
                if taken.read(1):
                    raise DeltaError(f"{literals.name} holds more than its recipe uses")
            os.ftruncate(out, size)
        finally:
            os.close(out)
    except DeltaError:
        output.unlink(missing_ok=True)
        raise
    finally:
        for fd in fds.values():
            os.close(fd)
    return size, None if written is None else written.hexdigest()


def _base_fd(fds: dict[int, int], file_index: int, base_root: Path, names: Sequence[str]) -> int:
    """The open base file `file_index` (opened on first use; DeltaError when it is missing)."""
    if file_index not in fds:
        try:
            fds[file_index] = os.open(base_root / names[file_index], os.O_RDONLY | os.O_CLOEXEC)
        except OSError as error:
            raise DeltaError(f"base file {names[file_index]} is missing ({error.strerror})") from None
    return fds[file_index]


def _place(data: bytes, length: int, out: int | None, position: int, written: Any, short: str) -> None:
    """Hash `data` into `written` (unless None) and write it at `position` of the open file `out`
    (unless None: it is there already); it must be `length` bytes, else DeltaError saying `short`."""
    if len(data) != length:
        raise DeltaError(short)
    if out is not None:
        done = 0
        view = memoryview(data)
        while done < length:
            done += os.pwrite(out, view[done:], position + done)
    if written is not None:
        written.update(data)
