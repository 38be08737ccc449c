"""Spliced ranks of a job take turns on their device: a turn is a rank's stretch of work up to
its next collective, and an update of what the ranks share is taken a few operations apart.

Turns: ranks spliced on one device each hold their own gradients and activations until their
collective. Run side by side, the device holds all of them at once; run one after the other,
each rank waits at its collective with its private storages moved off the device
(collectives.py), so the device holds the private state of one rank at a time. A rank takes the
turn before running operations and gives it up when it reaches a collective, or starts waiting
in one; a holder whose queue stays empty for `GRACE` seconds (its process computes on its own,
or waits for something outside the server) loses it, so no rank waits for another that cannot
go on. A rank waiting for its turn sleeps until an event that could free it (every change of
what a rank can run notifies, `waits` included) or until an idle rank's grace runs out.

Updates: the ranks run the same update on parameters and optimizer state they share (dedup.py):
the first to update a shared storage writes a new one (executor.py `_write_apart`), the others
are squashed onto it (squash.py), and the old storage goes once every rank moved on. A rank that
went through its whole update alone would leave the device holding the old state and the new,
so a rank that just ran an operation on storages it shares with the others (executor.py
`_note_lead`: the others will be squashed onto its result) gives its turn up while another rank
of its job that can run is more than `WINDOW` operations behind it (since the last collective
both passed), and a free turn goes to such a rank first: the shared state is replaced a few
operations at a time.

A rank that cannot run (its queue is empty, it waits in a collective, it is held) holds no one
back, and the rank furthest behind never waits for a laggard: the pacing cannot deadlock, and it
only decides the order in which operations run, never what they compute. The sessions of one
rank on several devices here never wait for each other.

A rank waits for its turn on a condition of its own (`Runner.turn`), woken only by the events of
its job's turns above: not by every frame, collective or message of the server, each of which would
make every waiting thread take the GIL from the rank that runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from .session import Session


class Runner(Protocol):
    """What the pacing needs of a session's runner (runner.Runner): its session, the server-wide
    condition and its own for its turn (on the same lock), how far it got since its last
    collective, and whether it can run."""

    session: Session
    cond: threading.Condition
    turn: threading.Condition
    rounds: int
    ran: int
    idle_since: float
    stopping: bool
    held: bool
    waiting_on: Callable[[], bool] | None

    def idle(self) -> bool: ...


WINDOW = 4
"""Operations a rank may run ahead of another rank of its job on the device while it updates
storages they share (4 or 16 made no difference measurable to the step time here)."""
GRACE = 0.001
"""Seconds the holder of a turn keeps it with nothing to run (longer made no difference to the
device's peak here and cost step time: a rank's process that is off the CPU for a moment stalls
the others)."""


class Pace:
    """The runners of each job on one device, and the turns their spliced ranks take."""

    def __init__(self, window: int = WINDOW, grace: float = GRACE, enabled: bool = True) -> None:
        self.enabled = enabled
        """Whether ranks take turns at all (the daemon's splice_lean: off, they run side by side)."""
        self.window = window
        self.grace = grace
        self.jobs: dict[str, list[Runner]] = {}
        """Job id -> its runners here (changed under the server-wide condition)."""
        self.holders: dict[str, Runner] = {}
        """Job id -> the runner whose turn it is."""
        self.waiting = 0
        """Runners waiting for their turn (only then does progress notify)."""

    def join(self, runner: Runner) -> None:
        """Count a new runner of a job (call with the condition held)."""
        self.jobs.setdefault(runner.session.job_id, []).append(runner)

    def leave(self, runner: Runner) -> None:
        """Forget a runner (call with the condition held); whoever waited for it may go on."""
        job = runner.session.job_id
        runners = self.jobs.get(job, [])
        if runner in runners:
            runners.remove(runner)
        if not runners:
            self.jobs.pop(job, None)
        if self.holders.get(job) is runner:
            del self.holders[job]
        self._wake(runners)

    def take_turn(self, runner: Runner) -> None:
        """Before the runner runs operations: wait until the turn is free (or its holder lapsed)
        and no rank of the job that can run lags it by more than the window, and take it."""
        job = runner.session.job_id
        peers = self.jobs.get(job)
        if not self.enabled or peers is None or len(peers) < 2 or self.holders.get(job) is runner:
            return
        with runner.cond:
            while not runner.stopping:
                holder = self.holders.get(job)
                if holder is runner:
                    return
                free = holder is None or holder.session.rank == runner.session.rank or self._lapsed(holder)
                if free and not self._laggard(runner, peers, 0):
                    self.holders[job] = runner
                    return
                self.waiting += 1
                try:
                    runner.turn.wait(self._until_lapse(peers))
                finally:
                    self.waiting -= 1

    def give_turn(self, runner: Runner) -> None:
        """The runner reached a collective, or paused in an update: the turn is free."""
        job = runner.session.job_id
        if self.holders.get(job) is not runner:
            return
        with runner.cond:
            if self.holders.get(job) is runner:
                del self.holders[job]
                self._wake(self.jobs.get(job, ()))

    def waits(self, runner: Runner) -> None:
        """The runner starts waiting in a collective (call with the condition held): it can run
        nothing now, so it holds no turn, and a rank held back while it could run may go on."""
        job = runner.session.job_id
        if self.holders.get(job) is runner:
            del self.holders[job]
        self._wake(self.jobs.get(job, ()))

    def pauses(self, runner: Runner) -> Callable[[int], bool] | None:
        """What the executor asks after an operation of the runner that wrote a shared storage
        apart, `done` operations into its run: whether to give the device up there. None for a
        rank alone on the device."""
        peers = self.jobs.get(runner.session.job_id)
        if not self.enabled or peers is None or len(peers) < 2:
            return None

        def pause(done: int) -> bool:
            with runner.cond:  # after the device's lock, as everywhere both are held
                return self._laggard(runner, peers, done)

        return pause

    def ran(self, runner: Runner, count: int) -> None:
        """Count operations the runner ran; wake the runners waiting for their turn, unless the
        runner holds it (then none of them can take it before `give_turn` wakes them)."""
        runner.ran += count
        if self.waiting and self.holders.get(runner.session.job_id) is not runner:
            with runner.cond:
                self._wake(self.jobs.get(runner.session.job_id, ()))

    def passed_collective(self, runner: Runner) -> None:
        """The runner went past a collective: its count starts again from there."""
        runner.rounds += 1
        runner.ran = 0
        if self.waiting:
            with runner.cond:
                self._wake(self.jobs.get(runner.session.job_id, ()))

    def went_idle(self, runner: Runner) -> None:
        """The runner finished a frame, or is stopping (call with the condition held): a holder's
        grace starts, a laggard may no longer hold the others back."""
        if self.waiting:
            self._wake(self.jobs.get(runner.session.job_id, ()))
        if runner.stopping:
            runner.turn.notify_all()

    def _wake(self, runners: list[Runner] | tuple[()]) -> None:
        """Wake the runners of a job that wait for their turn (call with the condition held)."""
        if self.waiting:
            for runner in list(runners):
                runner.turn.notify_all()

    def _until_lapse(self, peers: list[Runner]) -> float | None:
        """Seconds until the grace of an idle rank of the job runs out: the one change of the turns
        that no event announces (None: no grace runs, a waiter sleeps until an event)."""
        now = time.monotonic()
        ends = [peer.idle_since + self.grace for peer in list(peers) if peer.idle() and not peer.stopping]
        return min((end - now + 1e-4 for end in ends if end > now), default=None)

    def _lapsed(self, holder: Runner) -> bool:
        """Whether the holder of a turn lost it: ended, or idle for longer than the grace."""
        return holder.stopping or (holder.idle() and time.monotonic() - holder.idle_since > self.grace)

    def _laggard(self, runner: Runner, peers: list[Runner], done: int) -> bool:
        """Whether another rank of the job that can run lags this one (`done` operations further
        than it counted) by more than the window."""
        ahead = (runner.rounds, runner.ran + done - self.window)
        rank = runner.session.rank
        return any(
            peer.session.rank != rank and (peer.rounds, peer.ran) < ahead and self._may_run(peer)
            for peer in list(peers)
        )

    def _may_run(self, peer: Runner) -> bool:
        """Whether a rank can run now, or ran until a moment ago and is likely to send more
        (its process is still producing the operations the others have run)."""
        if not peer.idle():
            return True
        if peer.waiting_on is not None or peer.held or peer.stopping:
            return False
        return time.monotonic() - peer.idle_since < self.grace
