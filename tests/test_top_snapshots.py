"""SVG snapshots of `sing top` over fixed data with a frozen clock (pytest-textual-snapshot).

Refresh them after an intended change with `pytest tests/test_top_snapshots.py --snapshot-update`
and look at the pictures (the report names them) before committing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable, Input

from singularity.cli.top.app import TopApp
from singularity.cli.top.screens import ChoiceScreen, ConfirmScreen
from tests.top_data import FixedSource

SIZE = (150, 46)
Compare = Callable[..., bool]


@pytest.fixture(autouse=True)
def utc() -> Iterator[None]:
    """Times of day print the same everywhere."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield
    if before is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = before
    time.tzset()


def app(**options: Any) -> TopApp:
    """The app over the fixed data, refreshing only when something asks it to."""
    return TopApp(FixedSource(**options), refresh_seconds=3600)


async def settled(pilot: Pilot[None]) -> None:
    """Wait until the data, the chosen job's detail and its log have arrived (however slow the machine)."""
    top = pilot.app
    assert isinstance(top, TopApp)
    top.query_one("#filter", Input).cursor_blink = False
    for _ in range(600):
        if top.reachable is False:
            break
        if top.refreshes and top.selected is not None and top.log_ended == top.selected:
            detail = top._detail
            if detail is not None and detail.job.id == top.selected:
                break
        await pilot.pause(0.05)
    else:
        raise AssertionError("sing top did not settle")
    await pilot.pause()


def test_overview(snap_compare: Compare) -> None:
    """Devices with bars and ranks, jobs in colour with reasons and checkpoints, the chosen job."""
    assert snap_compare(app(), terminal_size=SIZE, run_before=settled)


def test_log_tab(snap_compare: Compare) -> None:
    assert snap_compare(app(), terminal_size=SIZE, run_before=settled, press=["4"])


def test_events_tab(snap_compare: Compare) -> None:
    assert snap_compare(app(), terminal_size=SIZE, run_before=settled, press=["3"])


def test_checkpoints_tab(snap_compare: Compare) -> None:
    assert snap_compare(app(), terminal_size=SIZE, run_before=settled, press=["2"])


def test_sorted_by_priority_and_filtered(snap_compare: Compare) -> None:
    """`o` five times sorts by PRI, `O` reverses, `/alice` filters."""
    keys = ["o", "o", "o", "o", "o", "O", "slash", "a", "l", "i", "c", "e", "enter"]
    assert snap_compare(app(), terminal_size=SIZE, run_before=settled, press=keys)


def test_with_ended_jobs(snap_compare: Compare) -> None:
    async def show_all(pilot: Pilot[None]) -> None:
        """Settle, then show ended jobs too and wait for that refresh."""
        await settled(pilot)
        top = pilot.app
        assert isinstance(top, TopApp)
        before = top.refreshes
        await pilot.press("a")
        while top.refreshes == before:
            await pilot.pause(0.05)

    assert snap_compare(app(), terminal_size=SIZE, run_before=show_all)


def test_confirmation(snap_compare: Compare) -> None:
    assert snap_compare(app(), terminal_size=SIZE, run_before=settled, press=["p"])


def test_help(snap_compare: Compare) -> None:
    assert snap_compare(app(), terminal_size=SIZE, run_before=settled, press=["question_mark"])


def test_daemon_unreachable(snap_compare: Compare) -> None:
    assert snap_compare(app(reachable=False), terminal_size=SIZE, run_before=settled)


def test_peers_pane(snap_compare: Compare) -> None:
    """In a cluster: the peers pane with states, free devices and last contact."""
    assert snap_compare(app(peers=True), terminal_size=SIZE, run_before=settled)


def test_migration_asks_which_peer(snap_compare: Compare) -> None:
    """`m` offers only the peers alive, not draining and with room for the job."""
    assert snap_compare(app(peers=True), terminal_size=SIZE, run_before=settled, press=["m"])


async def test_migration_goes_to_the_chosen_peer_after_a_confirmation() -> None:
    source = FixedSource(peers=True)
    top = TopApp(source, refresh_seconds=3600)
    async with top.run_test(size=SIZE) as pilot:
        await settled(pilot)
        chosen = top.selected
        await pilot.press("m")
        assert isinstance(top.screen, ChoiceScreen)
        assert [node for node, _ in top.screen.choices] == ["node-b"], "node-c is draining, node-d dead"
        await pilot.press("escape")
        assert not isinstance(top.screen, ChoiceScreen) and source.actions == []
        await pilot.press("m", "1")
        assert isinstance(top.screen, ConfirmScreen)
        assert top.screen.question.endswith("to node-b?")
        await pilot.press("y")
        for _ in range(200):
            if source.actions:
                break
            await pilot.pause(0.05)
        assert source.actions == [("migrate", chosen, "node-b")]


async def test_a_refresh_right_after_a_cursor_move_keeps_it() -> None:
    """A refresh that lands between a key moving the jobs cursor and the table's message about it
    (a busy machine) leaves the cursor where the key put it, and that job becomes the chosen one."""
    top = app()
    async with top.run_test(size=SIZE) as pilot:
        await settled(pilot)
        table = top.query_one("#jobs", DataTable)
        first = top.selected
        table.move_cursor(row=table.cursor_row + 1, animate=False)
        moved_to = top._job_at_cursor()
        assert moved_to is not None and moved_to != first
        top._sync_jobs(top.source.now())  # before the highlight message is handled
        for _ in range(200):
            if top.selected == moved_to:
                break
            await pilot.pause(0.05)
        assert (top.selected, top._job_at_cursor()) == (moved_to, moved_to)


def test_resize_asks_how_many_devices(snap_compare: Compare) -> None:
    """`z` on a running job of 4 ranks on 2 devices offers 1, 3 and 4 devices."""
    assert snap_compare(app(), terminal_size=SIZE, run_before=settled, press=["z"])


async def test_resize_goes_to_the_chosen_size_after_a_confirmation() -> None:
    source = FixedSource()
    top = TopApp(source, refresh_seconds=3600)
    async with top.run_test(size=SIZE) as pilot:
        await settled(pilot)
        chosen = top.selected
        assert chosen is not None and top.jobs[chosen].ranks == 4 and top.jobs[chosen].gpus == 2
        await pilot.press("z")
        assert isinstance(top.screen, ChoiceScreen)
        assert [size for size, _ in top.screen.choices] == ["1", "3", "4"]
        await pilot.press("2")
        assert isinstance(top.screen, ConfirmScreen)
        assert top.screen.question.endswith("to 3 devices?")
        await pilot.press("y")
        for _ in range(200):
            if source.actions:
                break
            await pilot.pause(0.05)
        assert source.actions == [("resize", chosen, "3")]
