"""A one-line progress indication on stderr while `sing` waits on something slow.

Only when stderr is a terminal: scripts and pipes see nothing of it. The line (a spinner, what
is being waited for and the seconds elapsed) is redrawn in place and erased when the wait ends,
so the command's own results on stdout are never mixed with it.
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import TextIO

FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
INTERVAL_S = 0.1


class Progress:
    """A context manager showing `label` and the time elapsed until the block ends."""

    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self._label = label
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = time.monotonic()

    @property
    def active(self) -> bool:
        """Whether anything is drawn (stderr is a terminal)."""
        try:
            return self.stream.isatty()
        except (AttributeError, ValueError):
            return False

    def update(self, label: str) -> None:
        """Say what is being waited for now."""
        with self._lock:
            self._label = label

    def __enter__(self) -> Progress:
        self._started = time.monotonic()
        if self.active:
            self._thread = threading.Thread(target=self._draw, name="sing-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
            self._write("\r\033[K")

    def _draw(self) -> None:
        """Redraw the line every INTERVAL_S until the block ends (the first frame at once)."""
        frame = 0
        while not self._done.wait(INTERVAL_S if frame else 0):
            with self._lock:
                label = self._label
            elapsed = time.monotonic() - self._started
            self._write(f"\r\033[K{FRAMES[frame % len(FRAMES)]} {label} {elapsed:.1f}s")
            frame += 1

    def _write(self, text: str) -> None:
        """Write to the stream; a stream that went away ends the drawing."""
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            self._done.set()
