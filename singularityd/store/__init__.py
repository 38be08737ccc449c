"""Durable state in SQLite (WAL): jobs and their specs, the event log, device assignments,
holdings between peers and small settings.

The store is made of one part per concern, all over one connection (database.py): the schema
and opening (schema.py), the jobs and their events (jobs.py), jobs travelling between peers
(transfer.py), holdings and settings (holdings.py); what it hands out is in records.py.
"""

from __future__ import annotations

from singularityd.store.holdings import Holdings
from singularityd.store.records import EventRecord, JobRecord, JobSpec
from singularityd.store.schema import StoreError
from singularityd.store.transfer import JobTransfer

__all__ = ["EventRecord", "JobRecord", "JobSpec", "Store", "StoreError"]


class Store(JobTransfer, Holdings):
    """The SQLite state store; one instance per daemon, used from the daemon's event loop."""
