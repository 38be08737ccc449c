"""The hand-off driver: two daemons' drivers over the real mTLS peer service, the daemon's work faked."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from singularityd.federation import handoff as h
from singularityd.federation.driver import Handoffs, MemoryStore
from singularityd.federation.peer import PeerChannels, PeerServer, PeerService
from tests.federation.conftest import Lab


@dataclass
class RecordedWork:
    """The daemon's side of moves, recorded; `problem` and `fail` make it refuse or fail a step."""

    problem: str = ""
    fail: str = ""
    calls: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def spec_json(self, job_id: str) -> bytes:
        """A spec the fake host check ignores."""
        return b"{}"

    async def host_problem(self, job_id: str, spec_json: bytes) -> str:
        """The configured refusal."""
        return self.problem

    async def _do(self, call: str) -> None:
        self.calls.append(call)
        if self.fail and call.startswith(self.fail):
            raise RuntimeError(f"{self.fail} failed")

    async def stop_for_move(self, job_id: str, epoch: int) -> None:
        """Recorded."""
        await self._do(f"stop {job_id} {epoch}")

    async def send_checkpoint(self, job_id: str, peer: str, epoch: int) -> None:
        """Recorded."""
        await self._do(f"send {job_id} {peer} {epoch}")

    async def resume_here(self, job_id: str) -> None:
        """Recorded."""
        await self._do(f"resume {job_id}")

    async def drop_local_copy(self, job_id: str, peer: str) -> None:
        """Recorded."""
        await self._do(f"drop {job_id} {peer}")

    async def restore_frozen(self, job_id: str, epoch: int) -> None:
        """Recorded."""
        await self._do(f"restore {job_id} {epoch}")

    async def release_frozen(self, job_id: str, epoch: int) -> None:
        """Recorded."""
        await self._do(f"release {job_id} {epoch}")

    async def discard_incoming(self, job_id: str, epoch: int) -> None:
        """Recorded."""
        await self._do(f"discard {job_id} {epoch}")

    def note(self, job_id: str, text: str) -> None:
        """Recorded."""
        self.notes.append(text)


@dataclass
class Daemon:
    """One side: its store, its recorded work, its driver and its peer server."""

    store: MemoryStore
    work: RecordedWork
    driver: Handoffs
    server: PeerServer


@pytest.fixture
async def pair(lab: Lab) -> AsyncIterator[dict[str, Daemon]]:
    """node-a owning job j, and node-b, each with a driver behind a real peer server."""
    daemons: dict[str, Daemon] = {}
    addresses: dict[str, str] = {}
    for name in ("node-a", "node-b"):
        identity = lab.identity(name)
        store, work = MemoryStore(), RecordedWork()
        driver = Handoffs(store, work, PeerChannels(identity), addresses.__getitem__)
        server = PeerServer(identity, "127.0.0.1:0", PeerService(handoffs=driver))
        addresses[name] = f"127.0.0.1:{await server.start()}"
        daemons[name] = Daemon(store, work, driver, server)
    daemons["node-a"].store.save(h.initial_holding("j"))
    yield daemons
    for daemon in daemons.values():
        await daemon.driver.close()
        await daemon.driver.channels.close()
        await daemon.server.stop(0)


async def settle(*daemons: Daemon) -> None:
    """Wait until no driver has work in flight."""
    for _ in range(200):
        if not any(d.driver.busy for d in daemons):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("drivers never settled")


async def test_a_move_runs_every_step_in_order_on_both_daemons(pair: dict[str, Daemon]) -> None:
    a, b = pair["node-a"], pair["node-b"]
    result = await asyncio.wait_for(a.driver.move("j", "node-b"), 30)
    assert result == h.MoveFinished(True, "node-b")
    await settle(a, b)
    assert a.work.calls == ["stop j 2", "send j node-b 2", "drop j node-b"]
    assert b.work.calls == ["restore j 2", "release j 2"]
    assert a.store.holdings["j"].phase is h.Phase.HANDED_OFF
    assert b.store.holdings["j"] == h.Holding("j", 2, h.Phase.OWNED, "node-a", committed=(2,))
    assert "moved to node-b (epoch 2)" in a.work.notes
    assert "commit from node-a: the job runs here (epoch 2)" in b.work.notes
    # And back: node-b now owns the job and moves it at the next epoch.
    back = await asyncio.wait_for(b.driver.move("j", "node-a"), 30)
    returned = a.store.load("j")
    assert back.ok and returned is not None and returned.phase is h.Phase.OWNED and returned.epoch == 3


async def test_a_second_move_of_a_moving_job_is_refused_and_the_first_still_learns_its_end(
    pair: dict[str, Daemon],
) -> None:
    """The refused second `move` took the first caller's place: `sing migrate` never returned."""
    a, b = pair["node-a"], pair["node-b"]
    first = asyncio.ensure_future(a.driver.move("j", "node-b"))
    while not a.work.calls:
        await asyncio.sleep(0.001)
    with pytest.raises(h.InvalidRequest, match="already moving"):
        await a.driver.move("j", "node-b")
    assert await asyncio.wait_for(first, 30) == h.MoveFinished(True, "node-b")
    await settle(a, b)


async def test_a_target_that_cannot_host_refuses_before_the_job_stops(pair: dict[str, Daemon]) -> None:
    a, b = pair["node-a"], pair["node-b"]
    b.work.problem = "/srv/run does not exist on this node (it must be shared)"
    result = await asyncio.wait_for(a.driver.move("j", "node-b"), 30)
    assert not result.ok and "does not exist on this node" in result.detail
    await settle(a, b)
    assert a.work.calls == [] and b.work.calls == []
    assert a.store.holdings["j"].phase is h.Phase.OWNED


async def test_a_failed_restore_gives_the_job_back_to_the_source(pair: dict[str, Daemon]) -> None:
    a, b = pair["node-a"], pair["node-b"]
    b.work.fail = "restore"
    result = await asyncio.wait_for(a.driver.move("j", "node-b"), 30)
    assert not result.ok and "could not restore" in result.detail
    await settle(a, b)
    assert a.work.calls == ["stop j 2", "send j node-b 2", "resume j"]
    assert b.work.calls[:2] == ["restore j 2", "discard j 2"]
    assert a.store.holdings["j"].phase is h.Phase.OWNED and not a.store.holdings["j"].abort_pending
    assert b.store.holdings["j"].phase is h.Phase.DISCARDED


async def test_an_unreachable_target_aborts_the_move_and_the_job_keeps_running(
    pair: dict[str, Daemon],
) -> None:
    a = pair["node-a"]
    a.driver.connect_retry_s = 1.0
    await pair["node-b"].server.stop(0)
    result = await asyncio.wait_for(a.driver.move("j", "node-b"), 60)
    assert not result.ok and "no answer from node-b to PREPARE" in result.detail
    assert re.search(r"cannot reach node-b at 127\.0\.0\.1:\d+ for \d+s \(.+\)$", result.detail), (
        result.detail
    )
    assert "\n" not in result.detail
    assert [n for n in a.work.notes if n.startswith("PREPARE: cannot reach node-b")], a.work.notes
    assert a.work.calls == [] and a.store.holdings["j"].abort_pending  # the abort is retried on ticks
    with pytest.raises(h.InvalidRequest, match="not owned"):
        await pair["node-b"].driver.move("j", "node-a")


async def test_a_target_that_comes_back_while_prepare_retries_takes_the_job(pair: dict[str, Daemon]) -> None:
    """The target's server is down when the move starts (a daemon restarting): PREPARE is refused
    a connection, tried again, and reaches the target once it listens again on its address."""
    a, b = pair["node-a"], pair["node-b"]
    a.driver.connect_retry_s = 60.0
    address = b.server.bind.replace(":0", f":{b.server.port}")
    await b.server.stop(0)
    moving = asyncio.ensure_future(a.driver.move("j", "node-b"))
    for _ in range(3000):
        if any(n.startswith("PREPARE: cannot reach node-b") for n in a.work.notes) or moving.done():
            break
        await asyncio.sleep(0.01)
    assert not moving.done() and b.work.calls == [], a.work.notes
    b.server = PeerServer(b.server.identity, address, PeerService(handoffs=b.driver))
    await b.server.start()
    result = await asyncio.wait_for(moving, 60)
    assert result == h.MoveFinished(True, "node-b"), a.work.notes
    await settle(a, b)
    assert a.work.calls == ["stop j 2", "send j node-b 2", "drop j node-b"]
    assert b.work.calls == ["restore j 2", "release j 2"]
