"""The store's jobs: submitted, listed, moved from state to state with their event log, and the
devices each holds.

Every state change is written in one transaction together with its event, before the daemon
acts on it, so a daemon killed at any moment restarts with a consistent queue.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from singularityd.core.states import JobState, Transition
from singularityd.errors import StoreUnwritable
from singularityd.federation.pki import job_id_block
from singularityd.store.database import Database
from singularityd.store.records import EventRecord, JobRecord, JobSpec, event_record, job_record

LISTED_STATES = tuple(state.value for state in JobState if state.is_listed)


class JobTable(Database):
    """The jobs of the state store and their events and devices."""

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
                                     checkpoint_interval, max_restarts, min_gpus, max_gpus, tier, state,
                                     reason, pending_reason, submitted_at)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
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
                    spec.tier,
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
        return job_record(row, self._devices_of([job_id]).get(job_id, ()))

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
        return [job_record(row, devices.get(int(row["id"]), ())) for row in fetched]

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
            if target.is_terminal or target is JobState.MOVED:  # MOVED: its time here ended
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
        return [event_record(row) for row in rows]

    def busy_devices(self) -> dict[int, int]:
        """Device index -> the job holding it."""
        rows = self._db.execute("SELECT device_index, job_id FROM device_assignments")
        return {int(row["device_index"]): int(row["job_id"]) for row in rows}
