"""How busy a device is: the time its server spends running work, in all and over the last second.

NVML reports a GPU's utilisation as the share of its last sample period (1/6 s to 1 s) during
which a kernel ran; `torch.cuda.utilization()`, `sing devices` and `sing top` show that figure.
A proxied device reports the same kind of figure for the time its server ran a job's operations.
Pure bookkeeping: the caller passes the clock's readings.
"""

from __future__ import annotations

BUCKET_SECONDS = 0.25
"""Busy time is kept per quarter of a second of the clock."""
WINDOW_BUCKETS = 4
"""The utilisation covers the last 4 whole buckets and the current part of one (1 to 1.25 s)."""
_KEPT_BUCKETS = 2 * WINDOW_BUCKETS


class BusyTime:
    """Intervals of work, nested or not, summed in total and per bucket of time."""

    def __init__(self) -> None:
        self.total_seconds = 0.0
        """Time spent working since the start (intervals still open not included)."""
        self._depth = 0
        self._since = 0.0
        self._buckets: dict[int, float] = {}

    def begin(self, now: float) -> None:
        """Work starts (an interval inside an open one adds nothing)."""
        if self._depth == 0:
            self._since = now
        self._depth += 1

    def end(self, now: float) -> None:
        """The work begun last ends."""
        self._depth -= 1
        if self._depth:
            return
        began = self._since
        self.total_seconds += now - began
        buckets = self._buckets
        bucket = int(began // BUCKET_SECONDS)
        while True:  # most work falls in one bucket: one pass
            edge = (bucket + 1) * BUCKET_SECONDS
            if now <= edge:
                buckets[bucket] = buckets.get(bucket, 0.0) + now - began
                break
            buckets[bucket] = buckets.get(bucket, 0.0) + edge - began
            began, bucket = edge, bucket + 1
        if len(buckets) > _KEPT_BUCKETS:
            for key in [key for key in buckets if key < bucket - _KEPT_BUCKETS]:
                del buckets[key]

    def utilization_percent(self, now: float) -> int:
        """The share of the last second or so spent working, 0 to 100, as NVML rounds it."""
        current = int(now // BUCKET_SECONDS)
        start = (current - WINDOW_BUCKETS) * BUCKET_SECONDS
        busy = sum(self._buckets.get(bucket, 0.0) for bucket in range(current - WINDOW_BUCKETS, current + 1))
        if self._depth:
            busy += now - max(self._since, start)
        return max(0, min(100, round(100 * busy / (now - start))))
