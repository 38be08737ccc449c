"""The turns spliced ranks take on a device (proxy/server/pace.py), with stand-in runners: who
may run, and that every change which frees a waiter wakes it (a waiter sleeps until an event)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from singularity.proxy.server.pace import Pace

JOB = "7"


class StandIn:
    """A session's runner as the pacing sees it (runner.Runner's fields, and its idle rule)."""

    def __init__(self, rank: int, lock: threading.RLock) -> None:
        self.session: Any = SimpleNamespace(job_id=JOB, rank=rank)
        self.cond = threading.Condition(lock)
        self.turn = threading.Condition(lock)
        self.rounds = 0
        self.ran = 0
        self.idle_since = 0.0
        self.stopping = False
        self.held = False
        self.waiting_on: Callable[[], bool] | None = None
        self.busy = True
        self.looked_at = 0
        """How often a waiter looked at whether this runner can run (each time it woke)."""

    def idle(self) -> bool:
        self.looked_at += 1
        if self.held or self.stopping:
            return True
        if self.waiting_on is not None:
            return not self.waiting_on()
        return not self.busy


def job_of(count: int, pace: Pace | None = None) -> tuple[Pace, list[StandIn]]:
    pace = pace or Pace()
    lock = threading.RLock()
    runners = [StandIn(rank, lock) for rank in range(count)]
    for runner in runners:
        pace.join(runner)
    return pace, runners


def take_in_thread(pace: Pace, runner: StandIn) -> threading.Thread:
    thread = threading.Thread(target=pace.take_turn, args=(runner,), daemon=True)
    thread.start()
    return thread


def still_waits(thread: threading.Thread) -> bool:
    thread.join(0.2)
    return thread.is_alive()


def test_a_holder_that_starts_waiting_in_a_collective_hands_the_turn_on_at_once() -> None:
    pace, (holder, waiter) = job_of(2)
    pace.take_turn(holder)
    assert pace.holders[JOB] is holder
    thread = take_in_thread(pace, waiter)
    assert still_waits(thread)  # the holder runs: its turn lasts
    with holder.cond:  # as Runner.wait does, without any other event
        holder.waiting_on = lambda: False
        pace.waits(holder)
    thread.join(5)
    assert not thread.is_alive() and pace.holders[JOB] is waiter


def test_a_rank_held_back_by_a_laggard_goes_on_when_the_laggard_waits_in_a_collective() -> None:
    pace, (ahead, laggard) = job_of(2)
    ahead.ran = 2 * pace.window
    pause = pace.pauses(ahead)
    assert pause is not None and pause(0)  # the laggard can run: the rank ahead gives the device up
    thread = take_in_thread(pace, ahead)
    assert still_waits(thread)
    with laggard.cond:  # it reached a collective without running anything (no turn to give up)
        laggard.waiting_on = lambda: False
        pace.waits(laggard)
    thread.join(5)
    assert not thread.is_alive() and pace.holders[JOB] is ahead
    assert not pause(0)


def test_a_holder_idle_past_the_grace_loses_the_turn() -> None:
    pace, (holder, waiter) = job_of(2)
    pace.take_turn(holder)
    thread = take_in_thread(pace, waiter)
    assert still_waits(thread)
    with holder.cond:  # its frame ended (Runner._loop): the grace starts
        holder.busy = False
        holder.idle_since = time.monotonic()
        pace.went_idle(holder)
    thread.join(5)
    assert not thread.is_alive() and pace.holders[JOB] is waiter


def test_the_rank_furthest_behind_never_waits_for_the_others() -> None:
    pace, (first, second, last) = job_of(3)
    first.ran, second.ran = 3 * pace.window, 2 * pace.window
    pace.take_turn(last)
    assert pace.holders[JOB] is last
    pace.give_turn(last)
    thread = take_in_thread(pace, first)
    assert still_waits(thread)  # the others lag it and can run
    last.ran = second.ran = first.ran
    pace.ran(last, 0)  # progress wakes the waiters
    thread.join(5)
    assert not thread.is_alive() and pace.holders[JOB] is first


def test_a_rank_alone_or_with_pacing_off_never_waits() -> None:
    pace, (alone,) = job_of(1)
    pace.take_turn(alone)
    assert pace.pauses(alone) is None and JOB not in pace.holders
    off, (one, two) = job_of(2, Pace(enabled=False))
    two.ran = 10 * off.window
    off.take_turn(one)
    off.take_turn(two)
    assert off.pauses(two) is None and not off.holders


def test_a_waiter_sleeps_through_the_holders_progress_and_the_servers_other_events() -> None:
    pace, (holder, waiter) = job_of(2)
    pace.take_turn(holder)
    thread = take_in_thread(pace, waiter)
    assert still_waits(thread)
    looked = holder.looked_at
    for _ in range(10):
        pace.ran(holder, 3)  # the holder runs on: no one else can take its turn
        with holder.cond:
            holder.cond.notify_all()  # a frame queued, a collective's member arrived
    assert still_waits(thread)
    assert holder.looked_at == looked, "the waiter was woken for nothing"
    pace.give_turn(holder)
    thread.join(5)
    assert not thread.is_alive() and pace.holders[JOB] is waiter
