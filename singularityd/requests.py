"""What the API hands the daemon, and the errors the daemon gives back for a refused request."""

from __future__ import annotations

from dataclasses import dataclass

import grpc


class RequestError(Exception):
    """A request the daemon refuses; `kind` picks the gRPC status the CLI maps to an exit code."""

    def __init__(self, kind: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def not_found(job_id: int) -> RequestError:
    """The error for a job id the store does not know."""
    return RequestError(grpc.StatusCode.NOT_FOUND, f"job {job_id} not found")


@dataclass(frozen=True)
class SubmitArgs:
    """A submission as the API received it, before validation."""

    command: tuple[str, ...]
    name: str
    gpus: int
    priority: int
    ranks: int
    cwd: str
    env: dict[str, str]
    checkpoint_interval: float | None = None
