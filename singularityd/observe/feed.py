"""The change feed: every change to a job is published here, and watchers subscribe to it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator


class ChangeFeed:
    """Fan-out of changed job ids to every open subscription (`sing ps -w`, `sing wait`)."""

    def __init__(self) -> None:
        self._subscribers: set[asyncio.Queue[int]] = set()

    def publish(self, job_id: int) -> None:
        """Tell every subscriber that this job changed."""
        for queue in self._subscribers:
            queue.put_nowait(job_id)

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[asyncio.Queue[int]]:
        """A queue that receives the id of every job that changes while the context is open."""
        queue: asyncio.Queue[int] = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            yield queue
        finally:
            self._subscribers.discard(queue)
