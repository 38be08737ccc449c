"""Membership (pure, with given times) and the heartbeat driver between real peer servers."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from singularityd.federation.heartbeat import Heartbeats
from singularityd.federation.membership import (
    DeviceInfo,
    Membership,
    PeerState,
    PeerStatus,
    Seed,
    Timing,
    parse_seed,
)
from singularityd.federation.peer import PeerChannels, PeerServer, PeerService, Refused
from singularityd.federation.v1 import peer_pb2 as pb
from tests.federation.conftest import Lab

T = Timing(interval_s=1.0, suspect_after_s=3.0, dead_after_s=10.0, dead_retry_s=30.0, seed_retry_s=5.0,
           forget_after_s=1000.0)  # fmt: skip
GPU = DeviceInfo(0, "virtual", "vdev", 1 << 30, True)


def status(node: str, free: int = 1, draining: bool = False) -> PeerStatus:
    """A heartbeat status of `node` with one device."""
    return PeerStatus(node, f"{node}:7070", "0.1.0", (GPU,), free, draining)


def test_seeds_parse_and_bad_ones_say_how_they_should_look() -> None:
    assert parse_seed("node-b@10.0.0.2:7070") == Seed("node-b", "10.0.0.2:7070")
    assert parse_seed("node-b@[fd00::2]:7070") == Seed("node-b", "[fd00::2]:7070")
    for bad in ("10.0.0.2:7070", "node-b@10.0.0.2", "Node_B@h:1", "node-b@:7070"):
        with pytest.raises(ValueError, match=r"should look like|cannot name a node"):
            parse_seed(bad)


def test_state_follows_the_silence_since_the_last_contact() -> None:
    m = Membership.from_seeds("a", [Seed("b", "b:1"), Seed("a", "a:1")], now=0.0, timing=T)
    assert list(m.members) == ["b"] and m.state("b", 0.0) is PeerState.DEAD
    m.heard_from(status("b"), 100.0)
    assert [m.state("b", t) for t in (100.0, 103.0, 104.0, 110.0, 111.0)] == [
        PeerState.ALIVE, PeerState.ALIVE, PeerState.SUSPECT, PeerState.SUSPECT, PeerState.DEAD,
    ]  # fmt: skip


def test_dead_seeds_are_still_contacted_so_a_long_partition_heals() -> None:
    m = Membership.from_seeds("a", [Seed("b", "b:1")], now=0.0, timing=T)
    m.heard_from(status("b"), 0.0)
    contacted = [t for t in range(0, 2000) if m.due(float(t))]
    # Every second while alive or suspect, then every seed_retry_s, however long the silence.
    assert contacted[:11] == list(range(11))
    assert all(b - a == 5 for a, b in itertools.pairwise(contacted[11:]))
    assert contacted[-1] >= 1995 and "b" in m.members
    m.heard_from(status("b"), 2000.0)
    assert m.state("b", 2000.0) is PeerState.ALIVE


def test_peers_learnt_from_others_are_forgotten_after_a_long_silence_seeds_never() -> None:
    m = Membership.from_seeds("a", [Seed("b", "b:1")], now=0.0, timing=T)
    m.learn([Seed("c", "c:1"), Seed("a", "a:1")], now=0.0)
    assert set(m.members) == {"b", "c"} and not m.members["c"].seed
    assert {s.node for s in m.due(1.0)} == {"b", "c"}
    m.due(1001.0)
    assert set(m.members) == {"b"}


def test_announced_addresses_replace_learnt_ones_but_not_configured_seeds() -> None:
    m = Membership.from_seeds("a", [Seed("b", "10.0.0.2:7070")], now=0.0, timing=T)
    m.learn([Seed("c", "old:1")], 0.0)
    m.heard_from(PeerStatus("c", "10.0.0.3:7070", "v"), 1.0)
    m.heard_from(PeerStatus("b", "elsewhere:1", "v"), 1.0)
    assert {s.node: s.address for s in m.known()} == {"b": "10.0.0.2:7070", "c": "10.0.0.3:7070"}


def test_the_peers_view_and_the_placement_hint() -> None:
    m = Membership.from_seeds("a", [Seed("b", "b:1"), Seed("c", "c:1"), Seed("d", "d:1")], now=0.0, timing=T)
    m.heard_from(status("b", free=1), 10.0)
    m.heard_from(status("c", free=3), 10.0)
    m.heard_from(status("d", free=4, draining=True), 10.0)
    m.contact_failed("b", "no route", 11.0)
    rows = {r.node: r for r in m.view(12.0)}
    assert rows["b"].state is PeerState.ALIVE and rows["b"].error == "no route" and rows["b"].devices == 1
    assert rows["c"].free == 3 and rows["c"].version == "0.1.0" and rows["c"].last_contact == 10.0
    assert rows["d"].draining
    assert m.with_room(1, 12.0) == ["c", "b"] and m.with_room(2, 12.0) == ["c"]
    assert m.with_room(1, 30.0) == []


async def test_heartbeats_make_two_real_peers_know_each_other(lab: Lab) -> None:
    a_id, b_id = lab.identity("node-a"), lab.identity("node-b")
    a_server = PeerServer(a_id, "127.0.0.1:0", PeerService())
    b_server = PeerServer(b_id, "127.0.0.1:0", PeerService())
    await a_server.start()
    await b_server.start()
    a_status = PeerStatus("node-a", f"127.0.0.1:{a_server.port}", "0.1.0", (GPU,), 1)
    b_status = PeerStatus("node-b", f"127.0.0.1:{b_server.port}", "0.1.0", (GPU, GPU), 2)
    now = time.time()
    a_members = Membership.from_seeds("node-a", [Seed("node-b", b_status.address)], now, T)
    a_members.learn([Seed("node-z", "127.0.0.1:1")], now)
    a = Heartbeats(a_members, PeerChannels(a_id), lambda: a_status)
    b = Heartbeats(Membership("node-b", T), PeerChannels(b_id), lambda: b_status)
    a_server.service.heartbeats, b_server.service.heartbeats = a, b
    try:
        assert sorted(await a.round()) == [False, True]  # node-b answers, node-z does not exist
        now = time.time()
        assert a.membership.state("node-b", now) is PeerState.ALIVE
        assert a.membership.members["node-b"].status == b_status
        assert b.membership.state("node-a", now) is PeerState.ALIVE
        assert b.membership.members["node-a"].status == a_status
        assert "node-z" in b.membership.members  # learnt from node-a's heartbeat
        assert "UNAVAILABLE" in a.membership.members["node-z"].last_error
        assert await b.round() in ([True, False], [False, True])  # node-b now calls node-a (and node-z)
    finally:
        await a.channels.close()
        await b.channels.close()
        await a_server.stop()
        await b_server.stop()


async def test_a_heartbeat_claiming_another_nodes_name_is_refused() -> None:
    beats = Heartbeats(Membership("node-a", T), PeerChannels.__new__(PeerChannels), lambda: status("node-a"))
    with pytest.raises(Refused, match="certificate names 'node-c'"):
        await beats.heartbeat("node-c", pb.HeartbeatRequest(sender=pb.NodeStatus(node="node-b")))
    assert beats.membership.members == {}


async def test_a_peer_that_never_answers_holds_back_no_other_peers_heartbeat(lab: Lab) -> None:
    """node-z accepts connections and never answers: node-a's heartbeats to node-b go on every
    interval meanwhile, so node-b stays alive (they waited for node-z's timeout, and node-b turned
    suspect)."""
    quick = Timing(interval_s=0.2, suspect_after_s=1.0, dead_after_s=10.0)
    held: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    silent = await asyncio.start_server(hold, "127.0.0.1", 0)
    silent_port = silent.sockets[0].getsockname()[1]
    b_server = PeerServer(lab.identity("node-b"), "127.0.0.1:0", PeerService())
    await b_server.start()
    b_status = PeerStatus("node-b", f"127.0.0.1:{b_server.port}", "0.1.0", (GPU,), 1)
    b = Heartbeats(Membership("node-b", quick), PeerChannels(lab.identity("node-b")), lambda: b_status)
    b_server.service.heartbeats = b
    seeds = [Seed("node-b", b_status.address), Seed("node-z", f"127.0.0.1:{silent_port}")]
    a = Heartbeats(
        Membership.from_seeds("node-a", seeds, time.time(), quick),
        PeerChannels(lab.identity("node-a")),
        lambda: status("node-a"),
        timeout_s=3.0,
    )
    stop = asyncio.Event()
    beating = asyncio.create_task(a.run(stop))
    try:
        states = []
        for _ in range(30):
            await asyncio.sleep(0.1)
            if a.membership.members["node-b"].last_contact is not None:
                states.append(a.membership.state("node-b", time.time()))
        assert len(states) >= 20 and set(states) == {PeerState.ALIVE}, states
        assert a.membership.state("node-z", time.time()) is PeerState.DEAD
    finally:
        stop.set()
        await beating
        await a.channels.close()
        await b.channels.close()
        await b_server.stop()
        for writer in held:
            writer.close()
        silent.close()
