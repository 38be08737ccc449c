"""`sing top`: a live view of the daemon's devices and jobs, with actions, in the terminal.

Background threads do every blocking call (the refresh loop, the log follower, the actions) and
only post messages; widgets are touched on the app's own thread, by the message handlers. Tables
are updated cell by cell in place, so a refresh never loses the cursor, the scroll position or
the sort, and nothing flickers.
"""

from __future__ import annotations

import codecs
import contextlib
import threading
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.widgets import DataTable, Footer, Input, Log, Static, TabbedContent, TabPane

from singularity.cli.errors import CliError
from singularity.cli.output import duration
from singularity.cli.source import ACTIONS, DataSource, LogStream
from singularity.cli.top import view
from singularity.cli.top.actions import JobActions
from singularity.cli.top.messages import ActionDone, LogData, LogEnded, Refreshed, Unreachable, while_shown
from singularity.cli.top.screens import HelpScreen
from singularityd.api.v1 import singularity_pb2 as pb

DETAIL_TABS = ("overview", "checkpoints", "events", "log")


class TopApp(JobActions):
    """The `sing top` application over any DataSource."""

    TITLE = "sing top"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    #banner { height: auto; display: none; padding: 0 1; }
    #banner.down { display: block; background: $error; color: $text; }
    #banner.notice { display: block; background: $warning; color: $text; }
    #title { height: 1; padding: 0 1; background: $panel; }
    #devices { height: auto; max-height: 12; border: round $primary-darken-2; }
    #peers { height: auto; max-height: 8; border: round $primary-darken-2; display: none; }
    #peers.shown { display: block; }
    #jobs { height: 1fr; min-height: 6; border: round $primary-darken-2; }
    #devices:focus, #jobs:focus { border: round $accent; }
    #filter { display: none; }
    #filter.shown { display: block; }
    #detail { height: 45%; }
    #overview { padding: 0 1; }
    ConfirmScreen, HelpScreen, ChoiceScreen { align: center middle; }
    #dialog { width: 64; height: auto; border: thick $error; background: $surface; padding: 1 2; }
    #explanation { margin: 1 0; }
    #buttons { height: auto; align: center middle; }
    #buttons Button { margin: 0 2; }
    #choices { height: auto; margin: 1 0; }
    #choices Button { width: 100%; margin: 0 0 1 0; }
    #help { width: 110; height: auto; max-height: 90%; border: thick $primary; background: $surface;
            padding: 1 2; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help"),
        Binding("slash", "filter", "Filter"),
        Binding("a", "toggle_all", "All"),
        Binding("o", "sort_next", "Sort"),
        Binding("O", "sort_reverse", "Reverse", show=False),
        *[
            Binding(
                action.key, f"job('{action.name}')", action.name.capitalize(), show=not action.unavailable
            )
            for action in ACTIONS
        ],
        *[Binding(str(n), f"tab('{tab}')", tab, show=False) for n, tab in enumerate(DETAIL_TABS, start=1)],
    ]

    def __init__(self, source: DataSource, *, refresh_seconds: float = 1.0, all_jobs: bool = False) -> None:
        super().__init__()
        self.source = source
        self.refresh_seconds = refresh_seconds
        self.all_jobs = all_jobs
        self.jobs: dict[int, pb.Job] = {}
        self.devices: list[pb.Device] = []
        self.peers = pb.ListPeersResponse()
        self.selected: int | None = None
        self.sort_key = "id"
        self.sort_reverse = False
        self.filter_words = ""
        self.refreshes = 0
        self.log_ended: int | None = None
        self.notices: list[str] = []
        self.reachable: bool | None = None
        self.daemon_started_at: float | None = None
        self._cells: dict[str, tuple[Any, ...]] = {}
        self._detail: pb.JobDetail | None = None
        self._detail_rows: dict[str, list[tuple[Any, ...]]] = {}
        self._log_stream: LogStream | None = None
        self._log_job: int | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()

    # Layout

    def compose(self) -> ComposeResult:
        """Banner, title, devices, jobs, filter, detail tabs, key bindings."""
        yield Static(id="banner")
        yield Static(Text("connecting to singularityd…"), id="title")
        devices: DataTable[Any] = DataTable(id="devices", cursor_type="none")
        devices.border_title = "Devices"
        yield devices
        peers: DataTable[Any] = DataTable(id="peers", cursor_type="none")
        peers.border_title = "Peers"
        yield peers
        jobs: DataTable[Any] = DataTable(id="jobs", cursor_type="row")
        jobs.border_title = "Jobs"
        yield jobs
        yield Input(
            placeholder="filter: words that must all appear (Enter keeps, Escape clears)", id="filter"
        )
        with TabbedContent(id="detail"):
            with TabPane("Overview", id="overview-tab"), VerticalScroll():
                yield Static(Text("no job chosen", style="dim"), id="overview")
            with TabPane("Checkpoints", id="checkpoints-tab"):
                yield DataTable(id="checkpoints", cursor_type="none")
            with TabPane("Events", id="events-tab"):
                yield DataTable(id="events", cursor_type="none")
            with TabPane("Log", id="log-tab"):
                yield Log(id="log", max_lines=10_000)
        yield Footer()

    def on_mount(self) -> None:
        """Set up the tables' columns and start the refresh thread."""
        devices = self.query_one("#devices", DataTable)
        for key, label, width in view.DEVICE_COLUMNS:
            devices.add_column(label, key=key, width=width)
        peers = self.query_one("#peers", DataTable)
        for key, label, width in view.PEER_COLUMNS:
            peers.add_column(label, key=key, width=width)
        jobs = self.query_one("#jobs", DataTable)
        for column in view.JOB_COLUMNS:
            jobs.add_column(column.label, key=column.key, width=column.width)
        self.query_one("#checkpoints", DataTable).add_columns(
            "SEQ", "TAKEN", "AGE", "SIZE", "PAUSE", "STATUS"
        )
        self.query_one("#events", DataTable).add_columns("TIME", "STATE", "EVENT")
        self._update_jobs_title()
        jobs.focus()
        self.run_worker(self._refresh_loop, thread=True, group="refresh", name="refresh")

    def on_unmount(self) -> None:
        """Stop the background threads (blocking calls are cut short by closing the source)."""
        self._stop.set()
        self._wake.set()
        if self._log_stream is not None:
            self._log_stream.cancel()
        close: Callable[[], None] | None = getattr(self.source, "close", None)
        if close is not None:
            close()

    # Background threads: they call the source and post messages, never touching widgets.

    def _refresh_loop(self) -> None:
        """Thread: read the daemon every refresh_seconds (or when woken) and post what was read."""
        while not self._stop.is_set():
            self._wake.clear()
            chosen = self.selected
            try:
                snapshot = self.source.snapshot(self.all_jobs)
            except CliError as error:
                self.post_message(Unreachable(error.message))
                self._wake.wait(self.refresh_seconds)
                continue
            detail = None
            if chosen is not None:
                with contextlib.suppress(CliError):
                    detail = self.source.job_detail(chosen)
            self.post_message(Refreshed(snapshot, detail))
            self._wake.wait(self.refresh_seconds)

    def _pump_log(self, stream: LogStream, job_id: int) -> None:
        """Thread: post each piece of a followed log, then its end."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        try:
            for data in stream:
                self.post_message(LogData(job_id, decoder.decode(data)))
            self.post_message(LogEnded(job_id, ""))
        except CliError as error:
            self.post_message(LogEnded(job_id, error.message))

    # Messages from the threads

    @while_shown
    def on_refreshed(self, message: Refreshed) -> None:
        """Apply a refresh: title, devices, jobs, and the chosen job's detail, all in place."""
        info = message.snapshot.info
        if self.reachable is False or (
            self.daemon_started_at is not None and info.started_at != self.daemon_started_at
        ):
            restarted = self.daemon_started_at is not None and info.started_at != self.daemon_started_at
            text = "singularityd restarted; reconnected" if restarted else "reconnected to singularityd"
            self._banner(f"{text} (up {duration(self.source.now() - info.started_at)})", "notice")
            self.set_timer(15, self._clear_notice)
        self.reachable = True
        self.daemon_started_at = info.started_at
        now = self.source.now()
        self.jobs = {job.id: job for job in message.snapshot.jobs}
        self.devices = list(message.snapshot.devices)
        self.peers = message.snapshot.peers
        self.query_one("#title", Static).update(
            view.title_text(info, self.source.where(), list(self.jobs.values()), now)
        )
        self._sync_devices()
        self._sync_peers(now)
        self._sync_jobs(now)
        if message.detail is not None and message.detail.job.id == self.selected:
            self._show_detail(message.detail, now)
        self.refreshes += 1

    @while_shown
    def on_unreachable(self, message: Unreachable) -> None:
        """Say the daemon is gone (the last data stays on screen) and keep retrying."""
        self.reachable = False
        retry = f"Retrying every {self.refresh_seconds:g}s"
        shown = "; showing the last data." if self.refreshes else "."
        self._banner(f"{message.reason}. {retry}{shown}", "down")

    @while_shown
    def on_log_data(self, message: LogData) -> None:
        """Append the followed job's new output."""
        if message.job_id == self._log_job:
            self.query_one("#log", Log).write(message.text)

    @while_shown
    def on_log_ended(self, message: LogEnded) -> None:
        """Mark the end of the log (or why following it failed)."""
        if message.job_id == self._log_job:
            self.log_ended = message.job_id
            if message.error:
                self.query_one("#log", Log).write(f"\n[sing top: {message.error}]\n")

    @while_shown
    def on_action_done(self, message: ActionDone) -> None:
        """Report what an action did."""
        self._announce(message.text, "information" if message.ok else "error")

    # Tables

    def _sync_devices(self) -> None:
        """Bring the devices table in line with the last refresh."""
        table = self.query_one("#devices", DataTable)
        for device in self.devices:
            key = f"dev{device.index}"
            cells = view.device_cells(device, self.jobs)
            self._put_row(table, key, cells, [c[0] for c in view.DEVICE_COLUMNS])
        self._keep_rows(table, {f"dev{d.index}" for d in self.devices})

    def _sync_peers(self, now: float) -> None:
        """Show the peers pane while this node is in a cluster, its rows in line with the last refresh."""
        table = self.query_one("#peers", DataTable)
        table.set_class(bool(self.peers.node), "shown")
        table.border_title = view.peers_title(self.peers) if self.peers.node else "Peers"
        columns = [column[0] for column in view.PEER_COLUMNS]
        for peer in self.peers.peers:
            self._put_row(table, f"peer:{peer.node}", view.peer_cells(peer, now), columns)
        self._keep_rows(table, {f"peer:{p.node}" for p in self.peers.peers})

    def _keep_rows(self, table: DataTable[Any], wanted: set[str]) -> None:
        """Remove the table's rows whose keys are not wanted any more."""
        for row in [str(r.value) for r in table.rows if r.value not in wanted]:
            table.remove_row(row)
            self._cells.pop(row, None)

    def _put_row(self, table: DataTable[Any], key: str, cells: tuple[Any, ...], columns: list[str]) -> None:
        """Add a row, or change only those cells of it whose content changed."""
        old = self._cells.get(key)
        if old is None or key not in table.rows:
            table.add_row(*cells, key=key)
        else:
            for column, new, previous in zip(columns, cells, old, strict=True):
                if new != previous:
                    table.update_cell(key, column, new, update_width=column in ("reason", "jobs"))
        self._cells[key] = cells

    def _sync_jobs(self, now: float) -> None:
        """Bring the jobs table in line with the jobs and the filter; the chosen job keeps the cursor."""
        table = self.query_one("#jobs", DataTable)
        shown = {str(j.id): j for j in self.jobs.values() if view.matches(j, self.filter_words)}
        # The job under the cursor, not the chosen one: a key that just moved the cursor has not
        # chosen its job yet (its highlight message comes after this refresh), and must not be undone.
        kept_cursor = self._job_at_cursor() if table.row_count else self.selected
        gone = [str(row.value) for row in table.rows if row.value not in shown]
        if gone and len(gone) > len(table.rows) // 2:
            for row in table.rows:
                self._cells.pop(str(row.value), None)
            table.clear()
        else:
            for key in gone:
                table.remove_row(key)
                self._cells.pop(key, None)
        for key, job in shown.items():
            self._put_row(table, key, view.job_cells(job, now), list(view.COLUMN_KEYS))
        self._sort(now)
        if kept_cursor is not None and str(kept_cursor) in shown:
            index = table.get_row_index(str(kept_cursor))
            if index != table.cursor_row:
                table.move_cursor(row=index, animate=False)
        elif table.row_count:
            self._choose(self._job_at_cursor())
        else:
            self._choose(None)
        self._update_jobs_title()

    def _sort(self, now: float) -> None:
        """Order the jobs table by the sort column's values (not its text)."""
        column = next(c for c in view.JOB_COLUMNS if c.key == self.sort_key)
        jobs = self.jobs

        def value(job_id: Any) -> Any:
            """The sort value of the job in a row, from its ID cell."""
            return column.sort_value(jobs[int(str(job_id))], now)

        self.query_one("#jobs", DataTable).sort("id", key=value, reverse=self.sort_reverse)

    def _update_jobs_title(self) -> None:
        """Say in the jobs pane's border how many jobs show, the sort and the filter."""
        table = self.query_one("#jobs", DataTable)
        label = next(c.label for c in view.JOB_COLUMNS if c.key == self.sort_key)
        title = f"Jobs ({table.row_count}" + (f" of {len(self.jobs)})" if self.filter_words else ")")
        title += f" · sorted by {label} {'↓' if self.sort_reverse else '↑'}"
        if self.filter_words:
            title += f" · filter: {self.filter_words}"
        if self.all_jobs:
            title += " · with ended jobs"
        table.border_title = title

    def _job_at_cursor(self) -> int | None:
        """The id of the job under the cursor, or None for an empty table."""
        table = self.query_one("#jobs", DataTable)
        if not table.row_count:
            return None
        row_key, _ = table.coordinate_to_cell_key(table.cursor_coordinate)
        return int(str(row_key.value))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        """Moving the cursor in the jobs table chooses the job the detail shows."""
        if event.data_table.id == "jobs" and event.row_key.value is not None:
            self._choose(int(event.row_key.value))

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        """A click on a jobs column header sorts by it; a second click reverses the order."""
        if event.data_table.id != "jobs":
            return
        key = str(event.column_key.value)
        self.sort_reverse = not self.sort_reverse if key == self.sort_key else False
        self.sort_key = key
        self._resort()

    def _resort(self) -> None:
        """Sort again after the sort changed, keeping the chosen job under the cursor."""
        self._sort(self.source.now())
        if self.selected is not None and str(self.selected) in self.query_one("#jobs", DataTable).rows:
            table = self.query_one("#jobs", DataTable)
            table.move_cursor(row=table.get_row_index(str(self.selected)), animate=False)
        self._update_jobs_title()

    # The chosen job

    def _choose(self, job_id: int | None) -> None:
        """Make a job the one the detail shows (None: no job), and follow its log."""
        if job_id == self.selected:
            return
        self.selected = job_id
        self._detail = None
        self._follow_log(job_id)
        if job_id is None:
            self.query_one("#overview", Static).update(Text("no job chosen", style="dim"))
        else:
            self.query_one("#overview", Static).update(Text(f"job {job_id}: loading…", style="dim"))
            self._wake.set()

    def _follow_log(self, job_id: int | None) -> None:
        """Stop following the previous job's log and start on this one's."""
        if self._log_stream is not None:
            self._log_stream.cancel()
            self._log_stream = None
        self._log_job = job_id
        self.log_ended = None
        log = self.query_one("#log", Log)
        log.clear()
        if job_id is None:
            return
        stream = self.source.follow_log(job_id, 0)
        self._log_stream = stream
        self.run_worker(
            partial(self._pump_log, stream, job_id), thread=True, group="log", exit_on_error=False
        )

    def _show_detail(self, detail: pb.JobDetail, now: float) -> None:
        """Fill the detail tabs from a fresh GetJob."""
        self._detail = detail
        self.query_one("#overview", Static).update(view.overview_text(detail, self.devices, now))
        self._fill("checkpoints", view.checkpoint_rows(detail, now))
        self._fill("events", view.event_rows(detail))

    def _fill(self, table_id: str, rows: list[Any]) -> None:
        """Replace a small table's rows when they changed."""
        if self._detail_rows.get(table_id) == rows:
            return
        self._detail_rows[table_id] = rows
        table = self.query_one(f"#{table_id}", DataTable)
        table.clear()
        table.add_rows(rows)
        if table_id == "events":
            table.scroll_end(animate=False)

    # Banner and notices

    def _banner(self, text: str, kind: str) -> None:
        """Show a line above everything: 'down' (red) or 'notice' (yellow)."""
        banner = self.query_one("#banner", Static)
        banner.update(text)
        banner.set_classes(kind)
        if kind == "notice":
            self._record(text)

    def _clear_notice(self) -> None:
        """Hide a notice banner (a 'down' one stays until the daemon is back)."""
        banner = self.query_one("#banner", Static)
        if banner.has_class("notice"):
            banner.set_classes("")

    # Key actions

    def action_help(self) -> None:
        """Show the keys."""
        self.push_screen(HelpScreen())

    def action_filter(self) -> None:
        """Show the filter box."""
        box = self.query_one("#filter", Input)
        box.add_class("shown")
        box.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        """Filter as one types."""
        self.filter_words = event.value
        self._sync_jobs(self.source.now())

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Enter keeps the filter and goes back to the jobs."""
        if not event.value:
            event.input.remove_class("shown")
        self.query_one("#jobs", DataTable).focus()

    def on_key(self, event: Any) -> None:
        """Escape in the filter box clears it."""
        box = self.query_one("#filter", Input)
        if event.key == "escape" and box.has_focus:
            box.value = ""
            box.remove_class("shown")
            self.query_one("#jobs", DataTable).focus()
            event.stop()

    def action_toggle_all(self) -> None:
        """Show ended jobs too, or only live ones."""
        self.all_jobs = not self.all_jobs
        self._update_jobs_title()
        self._wake.set()

    def action_sort_next(self) -> None:
        """Sort by the next column."""
        keys = view.COLUMN_KEYS
        self.sort_key = keys[(keys.index(self.sort_key) + 1) % len(keys)]
        self._resort()

    def action_sort_reverse(self) -> None:
        """Reverse the order."""
        self.sort_reverse = not self.sort_reverse
        self._resort()

    def action_tab(self, tab: str) -> None:
        """Show one of the detail tabs."""
        self.query_one("#detail", TabbedContent).active = f"{tab}-tab"
