"""The daemon's durable HoldingStore: each job's ownership record, a row of its SQLite store.

A holding is written (one transaction, synchronous to the WAL) before the hand-off driver
carries out any of its actions, so a daemon killed at any moment restarts knowing, for every job
it has seen, the highest epoch it recorded and what it was doing with it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict

from singularityd.federation.handoff import Holding, Phase
from singularityd.store import Store


def holding_to_json(holding: Holding) -> str:
    """A holding as the JSON kept in the store."""
    return json.dumps(asdict(holding), sort_keys=True)


def holding_from_json(text: str) -> Holding:
    """A holding read back from the store."""
    raw = json.loads(text)
    return Holding(
        job_id=str(raw["job_id"]),
        epoch=int(raw["epoch"]),
        phase=Phase(raw["phase"]),
        peer=str(raw.get("peer", "")),
        deadline=float(raw.get("deadline", 0.0)),
        abort_pending=bool(raw.get("abort_pending", False)),
        committed=tuple(int(e) for e in raw.get("committed", ())),
        discarded=tuple(int(e) for e in raw.get("discarded", ())),
        peer_hold_ends=float(raw.get("peer_hold_ends", 0.0)),
        resume_pending=bool(raw.get("resume_pending", False)),
    )


class StoredHoldings:
    """Holdings in the daemon's SQLite store (driver.HoldingStore)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def load(self, job_id: str) -> Holding | None:
        """The job's holding here, if any."""
        text = self.store.load_holding(job_id)
        return holding_from_json(text) if text is not None else None

    def save(self, holding: Holding) -> None:
        """Store a holding durably (before any of its actions is carried out)."""
        self.store.save_holding(holding.job_id, holding_to_json(holding))

    def all(self) -> Iterable[Holding]:
        """Every holding (for ticks and recovery)."""
        return [holding_from_json(text) for text in self.store.all_holdings()]
