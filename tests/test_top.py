"""`sing top` driven by Textual's Pilot against a real daemon on a real socket, running real jobs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from textual.coordinate import Coordinate
from textual.pilot import Pilot
from textual.widgets import DataTable, Log, Static

from singularity.cli.source import DaemonSource
from singularity.cli.top.app import TopApp
from singularity.cli.top.screens import ConfirmScreen, HelpScreen
from tests.conftest import requires_root
from tests.helpers import Daemon, running_daemon, submit_counter

SIZE = (150, 46)


async def until(pilot: Pilot[None], predicate: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Let the app run until the predicate holds (polling; fails the test after the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {predicate}")
        await pilot.pause(0.05)


def top(daemon: Daemon) -> TopApp:
    """The app on the daemon, refreshing five times a second."""
    return TopApp(DaemonSource(daemon.socket), refresh_seconds=0.2)


def cell(app: TopApp, table: str, row: str, column: str) -> str:
    """The plain text of a table cell."""
    value = app.query_one(f"#{table}", DataTable).get_cell(row, column)
    return str(getattr(value, "plain", value))


def log_lines(app: TopApp) -> list[str]:
    """The non-empty lines of the log tab."""
    return [line for line in app.query_one("#log", Log).lines if line]


async def test_devices_jobs_detail_and_live_log(daemon: Daemon) -> None:
    release = daemon.root / "release"
    counter = submit_counter(daemon, release, "--gpus", "2")
    waiting = daemon.submit("sleep", "300", options=["--gpus", "4", "--name", "waiter", "--priority", "-1"])
    daemon.wait_state(counter, "RUNNING")
    app = top(daemon)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: waiting in app.jobs and app.jobs[waiting].pending_reason)
        assert cell(app, "jobs", str(counter), "state") == "RUNNING"
        assert cell(app, "jobs", str(counter), "devices") == "0,1"
        assert cell(app, "jobs", str(waiting), "state") == "PENDING"
        assert cell(app, "jobs", str(waiting), "reason") == "Resources: needs 4 devices, 2 free"
        assert cell(app, "jobs", str(waiting), "priority") == "-1"
        assert cell(app, "devices", "dev0", "jobs") == f"{counter}:counter"
        assert cell(app, "devices", "dev2", "jobs") == "idle"
        assert cell(app, "devices", "dev0", "proxy") in ("starting", "up"), "its server, spawned at once"
        title = str(app.query_one("#title", Static).render())
        assert "singularityd 0.1.0" in title and "1 running" in title and "1 pending" in title

        assert app.selected == counter, "the first row is chosen"
        await until(pilot, lambda: app._detail is not None and app._detail.job.id == counter)
        overview = str(app.query_one("#overview", Static).render())
        assert "Command" in overview and "counter" in overview and "sharing device(s) 0,1" in overview
        await pilot.press("4")
        await until(pilot, lambda: len(log_lines(app)) >= 5)
        assert log_lines(app)[:5] == ["0", "1", "2", "3", "4"]

        await pilot.press("down")
        await until(pilot, lambda: app._detail is not None and app._detail.job.id == waiting)
        await pilot.press("1")
        overview = str(app.query_one("#overview", Static).render())
        assert "Resources: needs 4 devices, 2 free" in overview
        release.touch()


async def test_sort_by_header_click_and_keys_and_filter(daemon: Daemon) -> None:
    low = daemon.submit("sleep", "300", options=["--name", "low", "--priority", "-3"])
    high = daemon.submit("sleep", "300", options=["--name", "high", "--priority", "7"])
    middle = daemon.submit("sleep", "300", options=["--name", "middle"])
    app = top(daemon)
    async with app.run_test(size=SIZE) as pilot:
        table = app.query_one("#jobs", DataTable)
        await until(pilot, lambda: table.row_count == 3)

        def order() -> list[int]:
            """The job ids in table order."""
            keys = [
                table.coordinate_to_cell_key(Coordinate(row, 0)).row_key for row in range(table.row_count)
            ]
            return [int(str(key.value)) for key in keys]

        assert order() == [low, high, middle]
        columns = list(table.columns.values())
        before_priority = [str(c.key.value) for c in columns].index("priority")
        x = 1 + sum(c.get_render_width(table) for c in columns[:before_priority]) + 1
        await pilot.pause()
        assert await pilot.click("#jobs", offset=(x, 1)), "the click lands on the jobs table's header"
        await until(pilot, lambda: app.sort_key == "priority")
        assert order() == [low, middle, high]
        assert await pilot.click("#jobs", offset=(x, 1))
        await until(pilot, lambda: app.sort_reverse)
        assert order() == [high, middle, low]
        await pilot.press("o")
        assert app.sort_key == "gpus" and app.sort_reverse
        await pilot.press("O")
        assert not app.sort_reverse

        await pilot.press("slash", *"hig", "enter")
        assert order() == [high]
        assert "filter: hig" in str(table.border_title)
        await pilot.press("slash", "escape")
        assert table.row_count == 3

        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_actions_ask_first(daemon: Daemon) -> None:
    job = daemon.submit("sleep", "300", options=["--name", "victim"])
    daemon.wait_state(job, "RUNNING")
    app = top(daemon)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.selected == job)
        await pilot.press("c")
        assert isinstance(app.screen, ConfirmScreen)
        assert "Cancel job" in app.screen.question
        await pilot.press("n")
        assert not isinstance(app.screen, ConfirmScreen)
        await pilot.pause(0.5)
        assert daemon.job(job)["state"] == "RUNNING"

        await pilot.press("z")
        assert not isinstance(app.screen, ConfirmScreen)
        assert f"resize: job {job} has one rank: only a job of several ranks can be resized" in app.notices

        await pilot.press("m")
        assert not isinstance(app.screen, ConfirmScreen)
        assert "migrate: this daemon is in no cluster (sing cluster init / join)" in app.notices
        assert not app.query_one("#peers", DataTable).display, "no peers pane outside a cluster"

        await pilot.press("r", "y")
        refusal = await until(pilot, lambda: [n for n in app.notices if n.startswith(f"resume job {job}:")])
        assert "RUNNING" in refusal[0], "the daemon's refusal is shown"

        await pilot.press("c")
        assert await pilot.click("#yes")
        await until(pilot, lambda: any("cancel requested" in n for n in app.notices))
        daemon.wait_state(job, "CANCELLED")


async def test_reconnects_after_the_daemon_restarts(daemon: Daemon) -> None:
    job = daemon.submit("sleep", "300", options=["--name", "survivor"])
    daemon.wait_state(job, "RUNNING")
    app = top(daemon)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: job in app.jobs)
        await asyncio.to_thread(daemon.stop)
        await until(pilot, lambda: app.reachable is False)
        banner = str(app.query_one("#banner", Static).render())
        assert "cannot reach singularityd" in banner and "showing the last data" in banner
        assert job in app.jobs, "the last data stays"
        await asyncio.to_thread(daemon.start)
        await until(pilot, lambda: app.reachable)
        assert any("singularityd restarted; reconnected" in notice for notice in app.notices)
        await until(pilot, lambda: cell(app, "jobs", str(job), "state") == "RUNNING")


@requires_root
@pytest.mark.slow
async def test_suspend_and_resume_while_following_the_log(daemon_root: Path) -> None:
    """Through a suspension and a restore the log view loses and repeats no line."""
    with running_daemon(daemon_root, virtual_devices=2) as daemon:
        if "checkpoints unavailable" in daemon.sing("doctor").out:
            pytest.fail("CRIU must work for this test (run scripts/setup)")
        release = daemon.root / "release"
        job = submit_counter(daemon, release)
        daemon.wait_state(job, "RUNNING")
        app = top(daemon)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.selected == job)
            await pilot.press("a", "4")
            await until(pilot, lambda: len(log_lines(app)) >= 20)

            await pilot.press("s", "y")
            await until(pilot, lambda: app.jobs[job].state == "SUSPENDED", timeout=120)
            await until(pilot, lambda: cell(app, "jobs", str(job), "ckpt_age") != "-")
            suspended_at = len(log_lines(app))
            await pilot.press("r", "y")
            await until(pilot, lambda: app.jobs[job].state == "RUNNING" and not app.jobs[job].starting, 120)
            await until(pilot, lambda: len(log_lines(app)) > suspended_at + 20)
            release.touch()
            await until(pilot, lambda: app.log_ended == job)
            shown = log_lines(app)
        counted = shown[:-1]
        assert shown[-1] == "end"
        assert counted == [str(i) for i in range(len(counted))]
        assert len(counted) > suspended_at + 20
        assert daemon.sing("logs", str(job)).out.splitlines() == shown
        events = [e["reason"] for e in daemon.job(job)["events"]]
        assert any(reason.startswith("suspended by") for reason in events)
        assert any(reason.startswith("restored from checkpoint") for reason in events)
