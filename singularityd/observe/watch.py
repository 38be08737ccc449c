"""Watching a folder with watchdog (inotify), with each change delivered on the daemon's event loop.

The spool directory and the config file's folder are watched this way. watchdog calls back on
its own thread; the watch hands every name over to the loop, so what the daemon does with it
runs where all its other work runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from watchdog.events import (
    FileClosedEvent,
    FileCreatedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

log = logging.getLogger(__name__)
# watchdog logs every inotify event at debug level: too much for a daemon's debug log.
logging.getLogger("watchdog").setLevel(logging.INFO)

STOP_TIMEOUT_SECONDS = 5.0


class _Handler(FileSystemEventHandler):
    """Turns watchdog's events into names of entries of the folder, and whether each was just
    created (its content may still be on the way) or written and closed, or moved in."""

    def __init__(self, folder: Path, deliver: Callable[[str, bool], None]) -> None:
        self.folder = os.fspath(folder)
        self.deliver = deliver

    def dispatch(self, event: FileSystemEvent) -> None:
        """Hand on the name of the entry the event is about, if it is one of the folder's files."""
        if event.is_directory:
            return
        if isinstance(event, FileMovedEvent):
            path, created = event.dest_path, False
        elif isinstance(event, FileClosedEvent | FileCreatedEvent):
            path, created = event.src_path, isinstance(event, FileCreatedEvent)
        else:
            return
        folder, name = os.path.split(os.fsdecode(path))
        if folder == self.folder and name:
            self.deliver(name, created)


class FolderWatch:
    """Calls `on_change(name)` on the event loop for every file of `folder` (not its subfolders)
    that is written and closed, or moved in; and `on_created(name)`, when given, for every entry
    created there (a link or a fifo is never written and closed)."""

    def __init__(
        self,
        folder: Path,
        on_change: Callable[[str], None],
        on_created: Callable[[str], None] | None = None,
    ) -> None:
        self.folder = folder
        self.on_change = on_change
        self.on_created = on_created
        self._observer: BaseObserver | None = None

    def start(self) -> None:
        """Start watching (from the event loop); OSError when the folder cannot be watched."""
        loop = asyncio.get_running_loop()
        observer = Observer()

        def on_loop(name: str, created: bool) -> None:
            if self._observer is not observer:  # stopped meanwhile
                return
            if not created:
                self.on_change(name)
            elif self.on_created is not None:
                self.on_created(name)

        def deliver(name: str, created: bool) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closing
                loop.call_soon_threadsafe(on_loop, name, created)

        kinds: list[type[FileSystemEvent]] = [FileClosedEvent, FileMovedEvent]
        if self.on_created is not None:
            kinds.append(FileCreatedEvent)
        observer.schedule(
            _Handler(self.folder, deliver), os.fspath(self.folder), recursive=False, event_filter=kinds
        )
        observer.daemon = True
        try:
            observer.start()
        except BaseException:
            observer.stop()
            raise
        self._observer = observer

    def stop(self) -> None:
        """Stop watching; nothing is delivered afterwards."""
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            observer.join(STOP_TIMEOUT_SECONDS)
