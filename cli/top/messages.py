"""The messages `sing top`'s background threads post to the app, and a guard for their handlers."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar, cast

from textual.css.query import NoMatches
from textual.message import Message

from singularity.cli.source import Snapshot
from singularityd.api.v1 import singularity_pb2 as pb

Handler = TypeVar("Handler", bound=Callable[..., None])


def while_shown(handler: Handler) -> Handler:
    """For handlers of the threads' messages, which may arrive while the app is being torn down."""

    @wraps(handler)
    def guarded(*args: Any) -> None:
        """The handler, ignoring widgets that are already gone."""
        with contextlib.suppress(NoMatches):
            handler(*args)

    return cast(Handler, guarded)


class Refreshed(Message):
    """The refresh thread read the daemon: everything, plus the chosen job's detail."""

    def __init__(self, snapshot: Snapshot, detail: pb.JobDetail | None) -> None:
        super().__init__()
        self.snapshot = snapshot
        self.detail = detail


class Unreachable(Message):
    """The refresh thread could not reach the daemon."""

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason


class LogData(Message):
    """New output of the followed job's log."""

    def __init__(self, job_id: int, text: str) -> None:
        super().__init__()
        self.job_id = job_id
        self.text = text


class LogEnded(Message):
    """The followed log ended (the job ended), or following it failed."""

    def __init__(self, job_id: int, error: str) -> None:
        super().__init__()
        self.job_id = job_id
        self.error = error


class ActionDone(Message):
    """An action on a job finished; what came of it."""

    def __init__(self, text: str, ok: bool) -> None:
        super().__init__()
        self.text = text
        self.ok = ok
