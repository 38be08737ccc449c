"""Exceptions of the checkpoint layer: each carries one clear line and, where there is one, a log."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(Exception):
    """A checkpoint or restore failed; `message` is one line, `log_path` the CRIU log (if any).

    When a dump fails the job's processes are left running: a CheckpointError never means a
    half-killed job.
    """

    def __init__(self, message: str, log_path: Path | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.log_path = log_path

    def __str__(self) -> str:
        if self.log_path is None:
            return self.message
        return f"{self.message} (CRIU log: {self.log_path})"


class JobEnded(CheckpointError):
    """The job's processes ended while it was being checkpointed: there is nothing left to save, and
    the job ends as its exit says (not a failed checkpoint)."""


class DeviceConnectedMeanwhile(CheckpointError):
    """A process of the job connected to a device between the search for its device connections
    and the dump, which therefore failed; the job runs on, and a new checkpoint can be taken."""


class CheckpointUnavailable(CheckpointError):
    """Checkpoints cannot work here (no usable CRIU, user mode, a kernel feature missing)."""


class CriuError(CheckpointError):
    """CRIU ran and failed; `returncode` is its exit status."""

    def __init__(self, message: str, log_path: Path | None, returncode: int) -> None:
        super().__init__(message, log_path)
        self.returncode = returncode


class NoValidCheckpoint(CheckpointError):
    """A job has no checkpoint that passes verification."""
