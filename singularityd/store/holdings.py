"""The store's small records besides jobs: each job's holding between peers
(singularityd.federation.holdings) and daemon settings kept across restarts."""

from __future__ import annotations

from singularityd.store.database import Database


class Holdings(Database):
    """Holdings of jobs between peers, and small daemon settings, in the state database."""

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
