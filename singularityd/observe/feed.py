"""The change feed: what happens in the daemon is published here, and watchers subscribe to it.

Two kinds of listeners: subscriptions receive the id of every job that changed (`sing ps -w`,
`sing wait`); observers receive every observation as it happens (each stimulus the state
machine decided on, each submission, each scheduling round, each config reload), which is all
the metrics need, so nothing else in the daemon calls into them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from singularityd.core.decisions import Activity, Decision
from singularityd.core.states import JobState
from singularityd.core.stimuli import Stimulus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobSubmitted:
    """A job was queued (state PENDING) for this user."""

    job_id: int
    user: str


@dataclass(frozen=True)
class JobDecided:
    """The state machine decided on a stimulus for a job: its state and activity before, and the
    decision (a transition, the activity after, the actions taken)."""

    job_id: int
    user: str
    state: JobState
    activity: Activity
    stimulus: Stimulus
    decision: Decision


@dataclass(frozen=True)
class RoundPlanned:
    """A scheduling round ran over `queued` jobs in `seconds`, starting and preempting some."""

    seconds: float
    queued: int
    starts: int
    preemptions: int


@dataclass(frozen=True)
class ConfigReloaded:
    """The config file was read again: the options changed live, those needing a restart, or the
    error that kept the configuration as it was."""

    applied: tuple[str, ...]
    need_restart: tuple[str, ...]
    error: str = ""


@dataclass(frozen=True)
class SpoolFileHandled:
    """A job file in the spool directory was submitted (job_id) or refused (the reason)."""

    name: str
    job_id: int | None
    refusal: str = ""


Observation = JobSubmitted | JobDecided | RoundPlanned | ConfigReloaded | SpoolFileHandled
Observer = Callable[[Observation], None]


class ChangeFeed:
    """Fan-out of changed job ids to every open subscription, and of observations to observers."""

    def __init__(self) -> None:
        self._subscribers: set[asyncio.Queue[int]] = set()
        self._observers: list[Observer] = []

    def publish(self, job_id: int) -> None:
        """Tell every subscriber that this job changed."""
        for queue in self._subscribers:
            queue.put_nowait(job_id)

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[asyncio.Queue[int]]:
        """A queue that receives the id of every job that changes while the context is open."""
        queue: asyncio.Queue[int] = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            yield queue
        finally:
            self._subscribers.discard(queue)

    def observe(self, observer: Observer) -> None:
        """Call `observer` with every observation from now on (on the daemon's event loop)."""
        self._observers.append(observer)

    def report(self, observation: Observation) -> None:
        """Hand an observation to every observer; an observer's failure never reaches the daemon."""
        for observer in self._observers:
            try:
                observer(observation)
            except Exception:
                log.exception("observer %r failed on %r", observer, observation)
