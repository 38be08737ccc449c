"""Durable state in SQLite (WAL): jobs and their specs, the event log, device assignments.

Every state change is written in one transaction together with its event, before the daemon
acts on it, so a daemon killed at any moment restarts with a consistent queue.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from singularityd.core.states import JobState, Transition
from singularityd.errors import StoreUnwritable
from singularityd.federation.pki import job_id_block

SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    uid INTEGER NOT NULL,
    gid INTEGER NOT NULL,
    user TEXT NOT NULL,
    priority INTEGER NOT NULL,
    gpus INTEGER NOT NULL,
    ranks INTEGER NOT NULL,
    command TEXT NOT NULL,
    env TEXT NOT NULL,
    cwd TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL,
    pending_reason TEXT NOT NULL DEFAULT '',
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    submitted_at REAL NOT NULL,
    started_at REAL,
    ended_at REAL,
    exit_code INTEGER,
    signal INTEGER,
    cpu_seconds REAL,
    max_rss_bytes INTEGER,
    attempt INTEGER NOT NULL DEFAULT 0,
    checkpoint_interval REAL,
    init_pid INTEGER,
    init_start_ticks INTEGER,
    max_restarts INTEGER NOT NULL DEFAULT 0,
    restarts_used INTEGER NOT NULL DEFAULT 0,
    min_gpus INTEGER NOT NULL DEFAULT 0,
    max_gpus INTEGER NOT NULL DEFAULT 0,
    splice_refusal TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id INTEGER NOT NULL REFERENCES jobs (id),
    at REAL NOT NULL,
    from_state TEXT,
    to_state TEXT NOT NULL,
    reason TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_job ON events (job_id, id);
CREATE TABLE IF NOT EXISTS device_assignments (
    device_index INTEGER PRIMARY KEY,
    job_id INTEGER NOT NULL REFERENCES jobs (id),
    assigned_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS holdings (job_id TEXT PRIMARY KEY, holding TEXT NOT NULL);
"""
# holdings: this node's record of each job's ownership between peers (singularityd.federation).

ADDED_COLUMNS = {
    "max_restarts": "INTEGER NOT NULL DEFAULT 0",
    "restarts_used": "INTEGER NOT NULL DEFAULT 0",
    "min_gpus": "INTEGER NOT NULL DEFAULT 0",
    "max_gpus": "INTEGER NOT NULL DEFAULT 0",
    "splice_refusal": "TEXT NOT NULL DEFAULT ''",
}
"""Columns of the jobs table that a database created before them gets on open (their defaults
keep its jobs' behaviour)."""

LISTED_STATES = tuple(state.value for state in JobState if state.is_listed)
IMPORTED_COLUMNS = frozenset(
    {
        "id", "name", "uid", "gid", "user", "priority", "gpus", "ranks", "command", "env", "cwd",
        "submitted_at", "started_at", "ended_at", "exit_code", "signal", "cpu_seconds",
        "max_rss_bytes", "attempt", "checkpoint_interval", "max_restarts", "restarts_used",
        "min_gpus", "max_gpus", "splice_refusal",
    }
)  # fmt: skip
"""Columns that travel with a job to a peer (its state, pending reason, cancel flag and processes
describe it on one node only)."""


class StoreError(Exception):
    """The state database cannot be opened or written; the message says why."""


@dataclass(frozen=True)
class JobSpec:
    """What a user asked for; fixed at submission."""

    name: str
    uid: int
    gid: int
    user: str
    priority: int
    gpus: int
    ranks: int
    command: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    checkpoint_interval: float | None = None
    max_restarts: int = 0
    """How often a failed job is restored from its last checkpoint (or restarted) instead."""
    min_gpus: int = 0
    max_gpus: int = 0
    """An elastic job's range of devices (both 0: not elastic); `gpus` is its current size."""

    @property
    def elastic(self) -> bool:
        """Whether the scheduler may resize the job within its range."""
        return self.max_gpus > 0


@dataclass(frozen=True)
class JobRecord:
    """A job as stored: its spec and everything that has happened to it."""

    id: int
    spec: JobSpec
    state: JobState
    reason: str
    pending_reason: str
    cancel_requested: bool
    submitted_at: float
    started_at: float | None
    ended_at: float | None
    exit_code: int | None
    signal: int | None
    cpu_seconds: float | None
    max_rss_bytes: int | None
    attempt: int
    init_pid: int | None
    init_start_ticks: int | None
    devices: tuple[int, ...]
    restarts_used: int = 0
    splice_refusal: str = ""
    """Why the job's ranks may not share devices ('' unless its proxies found them not to be
    data-parallel replicas; scheduling/replicas.py)."""


@dataclass(frozen=True)
class EventRecord:
    """One entry of a job's event log."""

    job_id: int
    at: float
    from_state: JobState | None
    to_state: JobState
    reason: str


class Store:
    """The SQLite state store; one instance per daemon, used from the daemon's event loop.

    `node_number` chooses the block new job ids come from (see federation.pki.job_id_block), so
    ids stay unique across a lab cluster; 0 for a daemon in none.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.node_number = 0
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Specs hold every user's environment: the database is the daemon's alone (its -wal
            # and -shm files take the same mode).
            os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
            os.chmod(path, 0o600)
            self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._db.executescript(SCHEMA)
            self._add_missing_columns()
            self._check_version()
        except sqlite3.DatabaseError as error:
            raise StoreError(f"cannot open state database {path}: {error}") from None
        except OSError as error:
            raise StoreError(f"cannot open state database {path}: {error.strerror}") from None

    def _add_missing_columns(self) -> None:
        """Bring the jobs table of a database created before some of its columns up to date."""
        present = {row["name"] for row in self._db.execute("PRAGMA table_info(jobs)")}
        for name, declaration in ADDED_COLUMNS.items():
            if name not in present:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {declaration}")

    def _check_version(self) -> None:
        row = self._db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if row is None:
            self._db.execute(
                "INSERT INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
            )
        elif int(row["value"]) != SCHEMA_VERSION:
            raise StoreError(
                f"state database {self.path} has schema {row['value']}, this daemon knows {SCHEMA_VERSION}"
            )

    def close(self) -> None:
        """Close the database (WAL contents are checkpointed by SQLite)."""
        self._db.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; a database that cannot be written raises StoreUnwritable."""
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        except sqlite3.Error as error:
            raise StoreUnwritable(f"the daemon cannot write its state database: {error}") from error

    # Jobs

    def create_job(self, spec: JobSpec, at: float, reason: str) -> JobRecord:
        """Insert a new PENDING job and its first event; returns the stored record."""
        first, last = job_id_block(self.node_number)
        with self._transaction() as db:
            newest = db.execute("SELECT MAX(id) FROM jobs WHERE id BETWEEN ? AND ?", (first, last)).fetchone()
            job_id = max(first, int(newest[0] or 0) + 1)
            if job_id > last:
                raise StoreUnwritable(f"this node has given out every job id of its block ({first}-{last})")
            db.execute(
                """INSERT INTO jobs (id, name, uid, gid, user, priority, gpus, ranks, command, env, cwd,
                                     checkpoint_interval, max_restarts, min_gpus, max_gpus, state, reason,
                                     pending_reason, submitted_at)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                (
                    job_id,
                    spec.name,
                    spec.uid,
                    spec.gid,
                    spec.user,
                    spec.priority,
                    spec.gpus,
                    spec.ranks,
                    json.dumps(list(spec.command)),
                    json.dumps(spec.env),
                    spec.cwd,
                    spec.checkpoint_interval,
                    spec.max_restarts,
                    spec.min_gpus,
                    spec.max_gpus,
                    JobState.PENDING.value,
                    reason,
                    "waiting for the scheduler",
                    at,
                ),
            )
            db.execute(
                "INSERT INTO events (job_id, at, from_state, to_state, reason) VALUES (?, ?, NULL, ?, ?)",
                (job_id, at, JobState.PENDING.value, reason),
            )
        job = self.get(job_id)
        assert job is not None
        return job

    def get(self, job_id: int) -> JobRecord | None:
        """The job with this id, or None."""
        row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            return None
        return self._record(row, self._devices_of([job_id]).get(job_id, ()))

    def list_jobs(
        self, *, include_finished: bool = False, states: Iterable[JobState] = ()
    ) -> list[JobRecord]:
        """Jobs in id order: the live ones, all of them, or those in the given states."""
        wanted = [s.value for s in states]
        if wanted:
            marks = ",".join("?" * len(wanted))
            rows = self._db.execute(f"SELECT * FROM jobs WHERE state IN ({marks}) ORDER BY id", wanted)
        elif include_finished:
            rows = self._db.execute("SELECT * FROM jobs ORDER BY id")
        else:
            marks = ",".join("?" * len(LISTED_STATES))
            rows = self._db.execute(f"SELECT * FROM jobs WHERE state IN ({marks}) ORDER BY id", LISTED_STATES)
        fetched = rows.fetchall()
        devices = self._devices_of([int(r["id"]) for r in fetched]) if fetched else {}
        return [self._record(row, devices.get(int(row["id"]), ())) for row in fetched]

    def count_by_state(self) -> dict[JobState, int]:
        """How many jobs are in each state (states without jobs are left out)."""
        rows = self._db.execute("SELECT state, COUNT(*) AS n FROM jobs GROUP BY state")
        return {JobState(row["state"]): int(row["n"]) for row in rows}

    def _devices_of(self, job_ids: list[int]) -> dict[int, tuple[int, ...]]:
        found: dict[int, list[int]] = {}
        if len(job_ids) == 1:
            rows = self._db.execute(
                "SELECT job_id, device_index FROM device_assignments WHERE job_id = ? ORDER BY device_index",
                (job_ids[0],),
            )
        else:
            rows = self._db.execute(
                "SELECT job_id, device_index FROM device_assignments ORDER BY device_index"
            )
        for row in rows:
            found.setdefault(int(row["job_id"]), []).append(int(row["device_index"]))
        return {job_id: tuple(devices) for job_id, devices in found.items()}

    @staticmethod
    def _record(row: sqlite3.Row, devices: tuple[int, ...]) -> JobRecord:
        spec = JobSpec(
            name=row["name"],
            uid=row["uid"],
            gid=row["gid"],
            user=row["user"],
            priority=row["priority"],
            gpus=row["gpus"],
            ranks=row["ranks"],
            command=tuple(json.loads(row["command"])),
            env=json.loads(row["env"]),
            cwd=row["cwd"],
            checkpoint_interval=row["checkpoint_interval"],
            max_restarts=row["max_restarts"],
            min_gpus=row["min_gpus"],
            max_gpus=row["max_gpus"],
        )
        return JobRecord(
            id=row["id"],
            spec=spec,
            state=JobState(row["state"]),
            reason=row["reason"],
            pending_reason=row["pending_reason"],
            cancel_requested=bool(row["cancel_requested"]),
            submitted_at=row["submitted_at"],
            started_at=row["started_at"],
            ended_at=row["ended_at"],
            exit_code=row["exit_code"],
            signal=row["signal"],
            cpu_seconds=row["cpu_seconds"],
            max_rss_bytes=row["max_rss_bytes"],
            attempt=row["attempt"],
            init_pid=row["init_pid"],
            init_start_ticks=row["init_start_ticks"],
            devices=devices,
            restarts_used=row["restarts_used"],
            splice_refusal=row["splice_refusal"],
        )

    def record_transition(
        self,
        transition: Transition,
        *,
        devices: tuple[int, ...] | None = None,
        exit_code: int | None = None,
        signal: int | None = None,
        cpu_seconds: float | None = None,
        max_rss_bytes: int | None = None,
    ) -> None:
        """Write a state change and its event atomically, with what the new state implies.

        Entering RUNNING assigns `devices` and counts an attempt; entering MIGRATING assigns the
        devices given (reserved for a job arriving from a peer) or none; leaving the device-holding
        states releases them; a terminal state records the end time and the exit status.
        """
        target = transition.to_state
        with self._transaction() as db:
            db.execute(
                "UPDATE jobs SET state = ?, reason = ?, pending_reason = '' WHERE id = ?",
                (target.value, transition.reason, transition.job_id),
            )
            db.execute(
                "INSERT INTO events (job_id, at, from_state, to_state, reason) VALUES (?, ?, ?, ?, ?)",
                (
                    transition.job_id,
                    transition.at,
                    transition.from_state.value if transition.from_state else None,
                    target.value,
                    transition.reason,
                ),
            )
            if target is JobState.RUNNING:
                db.execute(
                    "UPDATE jobs SET started_at = COALESCE(started_at, ?), attempt = attempt + 1,"
                    " init_pid = NULL, init_start_ticks = NULL WHERE id = ?",
                    (transition.at, transition.job_id),
                )
                db.execute("DELETE FROM device_assignments WHERE job_id = ?", (transition.job_id,))
                db.executemany(
                    "INSERT INTO device_assignments (device_index, job_id, assigned_at) VALUES (?, ?, ?)",
                    [(d, transition.job_id, transition.at) for d in devices or ()],
                )
            elif target is JobState.MIGRATING:
                db.execute("DELETE FROM device_assignments WHERE job_id = ?", (transition.job_id,))
                db.executemany(
                    "INSERT INTO device_assignments (device_index, job_id, assigned_at) VALUES (?, ?, ?)",
                    [(d, transition.job_id, transition.at) for d in devices or ()],
                )
            elif not target.holds_devices:
                db.execute("DELETE FROM device_assignments WHERE job_id = ?", (transition.job_id,))
                db.execute(
                    "UPDATE jobs SET init_pid = NULL, init_start_ticks = NULL WHERE id = ?",
                    (transition.job_id,),
                )
            if target.is_terminal:
                db.execute(
                    """UPDATE jobs SET ended_at = ?, exit_code = ?, signal = ?,
                       cpu_seconds = COALESCE(?, cpu_seconds), max_rss_bytes = COALESCE(?, max_rss_bytes)
                       WHERE id = ?""",
                    (transition.at, exit_code, signal, cpu_seconds, max_rss_bytes, transition.job_id),
                )

    def add_note(self, job_id: int, state: JobState, reason: str, at: float) -> None:
        """Log an event that does not change the job's state (a checkpoint, a failed attempt)."""
        with self._transaction() as db:
            db.execute(
                "INSERT INTO events (job_id, at, from_state, to_state, reason) VALUES (?, ?, ?, ?, ?)",
                (job_id, at, state.value, state.value, reason),
            )

    def set_process(self, job_id: int, pid: int, start_ticks: int) -> None:
        """Remember the host PID (and its start time, against PID reuse) of the job's init."""
        with self._transaction() as db:
            db.execute(
                "UPDATE jobs SET init_pid = ?, init_start_ticks = ? WHERE id = ?",
                (pid, start_ticks, job_id),
            )

    def count_restart(self, job_id: int) -> None:
        """Count one restart of the job after a failure."""
        with self._transaction() as db:
            db.execute("UPDATE jobs SET restarts_used = restarts_used + 1 WHERE id = ?", (job_id,))

    def set_gpus(self, job_id: int, gpus: int) -> None:
        """Change how many devices the job runs on (a resize; its processes see as many as before)."""
        with self._transaction() as db:
            db.execute("UPDATE jobs SET gpus = ? WHERE id = ?", (gpus, job_id))

    def set_splice_refusal(self, job_id: int, reason: str) -> None:
        """Mark the job's ranks as not to share devices again, for `reason`."""
        with self._transaction() as db:
            db.execute("UPDATE jobs SET splice_refusal = ? WHERE id = ?", (reason, job_id))

    def set_cancel_requested(self, job_id: int) -> None:
        """Remember that the job's coming exit is a cancellation."""
        with self._transaction() as db:
            db.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = ?", (job_id,))

    def set_pending_reasons(self, reasons: dict[int, str]) -> None:
        """Store the scheduler's latest reason for every waiting job."""
        if not reasons:
            return
        with self._transaction() as db:
            db.executemany(
                "UPDATE jobs SET pending_reason = ? WHERE id = ? AND pending_reason != ?",
                [(reason, job_id, reason) for job_id, reason in reasons.items()],
            )

    def events(self, job_id: int) -> list[EventRecord]:
        """The job's event log, oldest first."""
        rows = self._db.execute(
            "SELECT job_id, at, from_state, to_state, reason FROM events WHERE job_id = ? ORDER BY id",
            (job_id,),
        )
        return [
            EventRecord(
                job_id=row["job_id"],
                at=row["at"],
                from_state=JobState(row["from_state"]) if row["from_state"] else None,
                to_state=JobState(row["to_state"]),
                reason=row["reason"],
            )
            for row in rows
        ]

    def busy_devices(self) -> dict[int, int]:
        """Device index -> the job holding it."""
        rows = self._db.execute("SELECT device_index, job_id FROM device_assignments")
        return {int(row["device_index"]): int(row["job_id"]) for row in rows}

    # Jobs moving between peer daemons

    def export_job(self, job_id: int) -> dict[str, Any]:
        """The job's row and event log as JSON-ready data, to travel with it to a peer."""
        row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise KeyError(job_id)
        record = {key: row[key] for key in sorted(IMPORTED_COLUMNS)}
        events = self._db.execute(
            "SELECT at, from_state, to_state, reason FROM events WHERE job_id = ? ORDER BY id", (job_id,)
        )
        return {"job": record, "events": [dict(event) for event in events]}

    def import_job(
        self,
        exported: dict[str, Any],
        reason: str,
        at: float,
        devices: tuple[int, ...] = (),
        notes: Iterable[tuple[float, str]] = (),
    ) -> JobRecord:
        """Take a job arriving from a peer: its row replaces any record of it here (a job that
        comes back); it is MIGRATING with `devices` reserved. Its event log is the one it brought
        merged, in time order, with what this node logged of it before (its own notes of an
        earlier stay), then the `notes` of this arrival and `reason`."""
        record = {key: value for key, value in exported["job"].items() if key in IMPORTED_COLUMNS}
        job_id = int(record["id"])
        previous = self.get(job_id)
        before = previous.state.value if previous is not None else None
        migrating = JobState.MIGRATING.value
        record.update(state=migrating, reason=reason, pending_reason="", cancel_requested=0)
        columns = sorted(record)
        brought = [
            (float(e["at"]), e["from_state"], str(e["to_state"]), str(e["reason"]))
            for e in exported.get("events", [])
        ]
        known = set(brought)
        kept = [
            event
            for e in self.events(job_id)
            if (event := (e.at, e.from_state.value if e.from_state else None, e.to_state.value, e.reason))
            not in known
        ]
        history = sorted(brought + kept, key=lambda e: e[0])
        history += [(when, migrating, migrating, text) for when, text in notes]
        history.append((at, before, migrating, reason))
        with self._transaction() as db:
            db.execute("DELETE FROM device_assignments WHERE job_id = ?", (job_id,))
            db.execute("DELETE FROM events WHERE job_id = ?", (job_id,))
            db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
            db.execute(
                f"INSERT INTO jobs ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                [record[c] for c in columns],
            )
            db.executemany(
                "INSERT INTO events (job_id, at, from_state, to_state, reason) VALUES (?, ?, ?, ?, ?)",
                [(job_id, *event) for event in history],
            )
            db.executemany(
                "INSERT INTO device_assignments (device_index, job_id, assigned_at) VALUES (?, ?, ?)",
                [(d, job_id, at) for d in devices],
            )
        job = self.get(job_id)
        assert job is not None
        return job

    # Holdings (singularityd.federation.holdings) and small settings

    def load_holding(self, job_id: str) -> str | None:
        """One job's stored holding (JSON), if any."""
        row = self._db.execute("SELECT holding FROM holdings WHERE job_id = ?", (job_id,)).fetchone()
        return str(row["holding"]) if row is not None else None

    def save_holding(self, job_id: str, holding: str) -> None:
        """Store a job's holding (JSON) before anything acts on it, synced to disk (a lost holding
        after a power cut could let two nodes run the job, or none)."""
        self._db.execute("PRAGMA synchronous=FULL")
        try:
            with self._transaction() as db:
                db.execute(
                    "INSERT INTO holdings (job_id, holding) VALUES (?, ?)"
                    " ON CONFLICT (job_id) DO UPDATE SET holding = excluded.holding",
                    (job_id, holding),
                )
        finally:
            self._db.execute("PRAGMA synchronous=NORMAL")

    def all_holdings(self) -> list[str]:
        """Every stored holding (JSON)."""
        rows = self._db.execute("SELECT holding FROM holdings ORDER BY job_id")
        return [str(row["holding"]) for row in rows]

    def setting(self, key: str) -> str | None:
        """A small daemon setting kept across restarts (such as draining), if set."""
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (f"setting:{key}",)).fetchone()
        return str(row["value"]) if row is not None else None

    def set_setting(self, key: str, value: str | None) -> None:
        """Keep (or with None, drop) a small daemon setting across restarts."""
        with self._transaction() as db:
            if value is None:
                db.execute("DELETE FROM meta WHERE key = ?", (f"setting:{key}",))
            else:
                db.execute(
                    "INSERT INTO meta (key, value) VALUES (?, ?)"
                    " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    (f"setting:{key}", value),
                )
