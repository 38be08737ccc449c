"""Jobs moving between peer daemons: a job's row and event log out to a peer, and in from one."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from singularityd.core.states import JobState
from singularityd.store.jobs import JobTable
from singularityd.store.records import JobRecord

IMPORTED_COLUMNS = frozenset(
    {
        "id", "name", "uid", "gid", "user", "priority", "gpus", "ranks", "command", "env", "cwd",
        "submitted_at", "started_at", "ended_at", "exit_code", "signal", "cpu_seconds",
        "max_rss_bytes", "attempt", "checkpoint_interval", "max_restarts", "restarts_used",
        "min_gpus", "max_gpus", "splice_refusal", "tier",
    }
)  # fmt: skip
"""Columns that travel with a job to a peer (its state, pending reason, cancel flag and processes
describe it on one node only)."""


class JobTransfer(JobTable):
    """The store's jobs, with the export and import of one job travelling to or from a peer."""

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
