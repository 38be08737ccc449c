"""Formatting of quantities shared by the daemon's event texts and the CLI's tables."""

from __future__ import annotations

from collections.abc import Sequence


def human_bytes(count: float) -> str:
    """1536 -> '1.5K'; binary units, like ps and nvtop."""
    for unit in ("B", "K", "M", "G"):
        if abs(count) < 1024:
            return f"{count:.0f}{unit}" if unit == "B" else f"{count:.1f}{unit}"
        count /= 1024
    return f"{count:.1f}T"


def first_few(items: Sequence[str], separator: str = "; ", most: int = 3) -> str:
    """The first `most` items on one line, and how many more: "a; b; c; and 2 more"."""
    more = len(items) - most
    return separator.join(items[:most]) + (f"{separator}and {more} more" if more > 0 else "")


def counted(count: int, noun: str) -> str:
    """(1, 'device') -> '1 device', (2, 'device') -> '2 devices'."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
