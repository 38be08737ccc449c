"""The state database as the store's parts share it: one connection, and one way to write."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from singularityd.errors import StoreUnwritable
from singularityd.store.schema import open_database


class Database:
    """The daemon's state database, open; the base of each part of the store (jobs, holdings).

    `node_number` chooses the block new job ids come from (see federation.pki.job_id_block), so
    ids stay unique across a lab cluster; 0 for a daemon in none.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.node_number = 0
        self._db = open_database(path)

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
