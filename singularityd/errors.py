"""Why the daemon refuses a request: plain errors, each with one line for the person who asked.

The domain raises these; only the API layer (singularityd.api) turns them into wire status codes,
and the CLI turns those into exit codes.
"""

from __future__ import annotations


class RequestError(Exception):
    """A request the daemon refuses; `message` is one line for the person who made it."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(RequestError):
    """The request names something that does not exist (an unknown job id)."""


class PermissionDenied(RequestError):
    """The caller may not act on what the request names (another user's job)."""


class InvalidRequest(RequestError):
    """The request itself is malformed (an empty command, a count below one, a relative path)."""


class Unsatisfiable(RequestError):
    """The request is well formed but this machine can never satisfy it (more devices than it has)."""


class StateConflict(RequestError):
    """The job's state does not allow the request now (preempting a queued job, a failed checkpoint)."""


class StoreUnwritable(RequestError):
    """The daemon cannot write its state database (a full disk, an I/O error); nothing is lost."""


def not_found(job_id: int) -> NotFound:
    """The error for a job id the store does not know."""
    return NotFound(f"job {job_id} not found")
