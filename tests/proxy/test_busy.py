"""A device's busy time and utilisation (proxy/server/busy.py), with the clock's readings given."""

from __future__ import annotations

import pytest

from singularity.proxy.server.busy import BusyTime


def worked(intervals: list[tuple[float, float]]) -> BusyTime:
    """A BusyTime that saw these intervals of work."""
    busy = BusyTime()
    for began, ended in intervals:
        busy.begin(began)
        busy.end(ended)
    return busy


def test_a_device_never_used_or_idle_for_a_second_and_more_is_at_zero() -> None:
    assert BusyTime().utilization_percent(100.0) == 0
    assert worked([(10.0, 99.0)]).utilization_percent(100.3) == 0


def test_the_share_of_the_last_second_worked_is_the_utilisation() -> None:
    busy = worked([(99.0 + k / 10, 99.0 + k / 10 + 0.05) for k in range(10)])
    assert busy.utilization_percent(100.0) == 50
    assert busy.total_seconds == pytest.approx(0.5)
    assert worked([(90.0, 100.0)]).utilization_percent(100.0) == 100


def test_work_still_running_counts_up_to_now() -> None:
    busy = BusyTime()
    busy.begin(50.0)
    assert busy.utilization_percent(100.0) == 100
    assert busy.total_seconds == 0, "counted in all once it ends"
    busy.end(100.0)
    assert busy.total_seconds == 50.0
    assert busy.utilization_percent(101.0) == 0


def test_nested_work_is_counted_once() -> None:
    busy = BusyTime()
    busy.begin(99.0)
    busy.begin(99.2)
    busy.end(99.4)
    assert busy.total_seconds == 0
    busy.end(99.5)
    assert busy.total_seconds == pytest.approx(0.5)
    assert busy.utilization_percent(100.0) == 50


def test_old_buckets_are_let_go() -> None:
    busy = worked([(t / 4, t / 4 + 0.1) for t in range(1000)])
    assert len(busy._buckets) <= 9
    assert busy.utilization_percent(250.0) == 40
