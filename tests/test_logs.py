"""Reading job logs (singularityd.jobs.logs): each chunk says where it starts, so a follower can
go on from there; an offset wins over a tail."""

from __future__ import annotations

from pathlib import Path

from singularityd.jobs.logs import CHUNK, read_log

LINES = b"".join(f"line {n}\n".encode() for n in range(20_000))


async def chunks(path: Path, *, tail: int | None = None, offset: int = 0) -> list[tuple[int, bytes]]:
    """Everything read_log yields without following."""
    return [c async for c in read_log(path, follow=False, tail=tail, offset=offset, ended=lambda: True)]


async def test_each_chunk_says_where_it_starts(tmp_path: Path) -> None:
    log = tmp_path / "rank-0.log"
    log.write_bytes(LINES)
    read = await chunks(log)
    assert len(read) > 1, "the log is longer than one chunk"
    assert [offset for offset, _ in read] == list(range(0, len(LINES), CHUNK))
    assert all(LINES[offset : offset + len(data)] == data for offset, data in read)


async def test_from_an_offset_or_the_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "rank-0.log"
    log.write_bytes(LINES)
    middle = LINES.index(b"line 12345\n")
    assert b"".join(d for _, d in await chunks(log, offset=middle)) == LINES[middle:]
    assert (await chunks(log, offset=middle, tail=2))[0][0] == middle, "the offset wins over the tail"
    last = LINES.index(b"line 19998\n")
    assert await chunks(log, tail=2) == [(last, LINES[last:])]
    assert await chunks(tmp_path / "missing.log", tail=2) == []
    assert await chunks(log, tail=0) == [], "a tail of 0 lines is none, as `tail -n 0`"
