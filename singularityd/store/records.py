"""What the state store hands out: a job's spec, the job as stored, an entry of its event log."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass

from singularityd.core.states import JobState
from singularityd.tiers import DEFAULT_TIER


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
    tier: str = DEFAULT_TIER
    """Its service tier (singularityd.tiers), which ranks it before its priority."""

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


def job_record(row: sqlite3.Row, devices: tuple[int, ...]) -> JobRecord:
    """The stored job in a row of the jobs table, holding `devices`."""
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
        tier=row["tier"],
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


def event_record(row: sqlite3.Row) -> EventRecord:
    """The event in a row of the events table."""
    return EventRecord(
        job_id=row["job_id"],
        at=row["at"],
        from_state=JobState(row["from_state"]) if row["from_state"] else None,
        to_state=JobState(row["to_state"]),
        reason=row["reason"],
    )
