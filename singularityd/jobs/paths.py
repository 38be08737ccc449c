"""Where one job's files live under the state directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class JobPaths:
    """Where one job's files live under the state directory."""

    root: Path

    @property
    def logs(self) -> Path:
        """Per-rank output, appended to across restarts."""
        return self.root / "logs"

    def rank_log(self, rank: int) -> Path:
        """stdout and stderr of one rank."""
        return self.logs / f"rank-{rank}.log"

    @property
    def supervisor_log(self) -> Path:
        """Messages of the job's supervisor itself."""
        return self.root / "supervisor.log"

    @property
    def status(self) -> Path:
        """Written by the supervisor when the job ends."""
        return self.root / "status.json"

    @property
    def pid(self) -> Path:
        """The supervisor's host PID, written by the launcher."""
        return self.root / "init.pid"

    @property
    def spec(self) -> Path:
        """The launch spec handed to the launcher."""
        return self.root / "launch.json"

    def rewind_paths(self, ranks: int) -> list[str]:
        """The job's append-only logs, which a restore cuts back to their size at the checkpoint."""
        return [str(self.rank_log(rank)) for rank in range(ranks)] + [str(self.supervisor_log)]
