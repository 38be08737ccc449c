"""Reading a job's logs for `sing logs`: from the start, a byte offset or the last lines, then new
output; each chunk comes with its offset, so a follower that lost its connection can go on."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

FOLLOW_POLL_SECONDS = 0.2
CHUNK = 64 * 1024


async def read_log(
    path: Path, *, follow: bool, tail: int | None, offset: int, ended: Callable[[], bool]
) -> AsyncIterator[tuple[int, bytes]]:
    """The log from byte `offset` when it is positive, else its last `tail` lines (none for 0)
    when a tail is given, else the start; if following, new output until `ended()`. Yields
    (offset of the chunk, chunk)."""
    offset = max(offset, 0)
    if offset == 0 and tail is not None and path.exists():
        offset = await asyncio.to_thread(offset_of_last_lines, path, tail)
    while True:
        finished = ended() or not follow
        with contextlib.suppress(FileNotFoundError), path.open("rb") as handle:
            handle.seek(offset)
            while chunk := handle.read(CHUNK):
                yield offset, chunk
                offset += len(chunk)
        if finished:
            return
        await asyncio.sleep(FOLLOW_POLL_SECONDS)


def offset_of_last_lines(path: Path, lines: int) -> int:
    """Byte offset where the last `lines` lines of a file begin."""
    with path.open("rb") as handle:
        handle.seek(0, os.SEEK_END)
        end = position = handle.tell()
        if lines <= 0:
            return end
        found = 0
        while position > 0:
            step = min(CHUNK, position)
            position -= step
            handle.seek(position)
            data = handle.read(step)
            if position + step == end and data.endswith(b"\n"):
                data = data[:-1]
            for index in range(len(data) - 1, -1, -1):
                if data[index] == 0x0A:
                    found += 1
                    if found == lines:
                        return position + index + 1
        return 0
