"""The state database's tables, and opening one: created when missing, brought up to date when
older, refused when newer than this daemon knows."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

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
    splice_refusal TEXT NOT NULL DEFAULT '',
    tier TEXT NOT NULL DEFAULT 'standard'
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
    "tier": "TEXT NOT NULL DEFAULT 'standard'",
}
"""Columns of the jobs table that a database created before them gets on open (their defaults
keep its jobs' behaviour)."""


class StoreError(Exception):
    """The state database cannot be opened or written; the message says why."""


def open_database(path: Path) -> sqlite3.Connection:
    """The state database at `path` (created, mode 0600, when missing), in WAL mode, with its
    tables present and up to date."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Specs hold every user's environment: the database is the daemon's alone (its -wal
        # and -shm files take the same mode).
        os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
        os.chmod(path, 0o600)
        db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA foreign_keys=ON")
        db.execute("PRAGMA busy_timeout=5000")
        db.executescript(SCHEMA)
        _add_missing_columns(db)
        _check_version(db, path)
    except sqlite3.DatabaseError as error:
        raise StoreError(f"cannot open state database {path}: {error}") from None
    except OSError as error:
        raise StoreError(f"cannot open state database {path}: {error.strerror}") from None
    return db


def _add_missing_columns(db: sqlite3.Connection) -> None:
    """Bring the jobs table of a database created before some of its columns up to date."""
    present = {row["name"] for row in db.execute("PRAGMA table_info(jobs)")}
    for name, declaration in ADDED_COLUMNS.items():
        if name not in present:
            db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {declaration}")


def _check_version(db: sqlite3.Connection, path: Path) -> None:
    """Record the schema version in a new database; refuse one of another version."""
    row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    if row is None:
        db.execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
    elif int(row["value"]) != SCHEMA_VERSION:
        raise StoreError(
            f"state database {path} has schema {row['value']}, this daemon knows {SCHEMA_VERSION}"
        )
