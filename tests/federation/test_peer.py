"""The peer service over loopback: mutual TLS, node names checked on both sides, refusals logged."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
import grpc.aio
import pytest

from singularityd.federation import tls
from singularityd.federation.peer import PeerChannels, PeerServer, PeerService, Refused
from singularityd.federation.pki import NodeIdentity
from singularityd.federation.v1 import peer_pb2 as pb
from tests.federation.conftest import Lab

DAY = 86400.0


@dataclass
class Recorder:
    """A heartbeat handler that records who called and can refuse."""

    callers: list[str] = field(default_factory=list)
    refuse: str = ""

    async def heartbeat(self, node: str, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        """Record the caller's certified name."""
        self.callers.append(node)
        if self.refuse:
            raise Refused(self.refuse)
        return pb.HeartbeatReply(status=pb.NodeStatus(node="server"))


async def serve(identity: NodeIdentity, recorder: Recorder, admit: tls.Admit = tls.admit_any) -> PeerServer:
    """A started peer server on a loopback port."""
    server = PeerServer(identity, "127.0.0.1:0", PeerService(heartbeats=recorder), admit=admit)
    await server.start()
    return server


async def heartbeat(client: NodeIdentity, node: str, port: int) -> pb.HeartbeatReply:
    """One heartbeat from `client` to the server it expects to be `node`."""
    channels = PeerChannels(client)
    try:
        reply: pb.HeartbeatReply = await channels.stub(node, f"127.0.0.1:{port}").Heartbeat(
            pb.HeartbeatRequest(), timeout=5
        )
        return reply
    finally:
        await channels.close()


async def refusal(client: NodeIdentity, node: str, port: int) -> str:
    """The one-line reason a heartbeat fails (the test fails if it succeeds)."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await heartbeat(client, node, port)
    return tls.describe_failure(caught.value, node, f"127.0.0.1:{port}")


async def test_peers_see_each_others_certified_names(lab: Lab) -> None:
    recorder = Recorder()
    server = await serve(lab.identity("node-b"), recorder)
    try:
        reply = await heartbeat(lab.identity("node-c"), "node-b", server.port)
        assert reply.status.node == "server" and recorder.callers == ["node-c"]
        channels = PeerChannels(lab.identity("node-c"))
        assert await channels.healthy("node-b", f"127.0.0.1:{server.port}")
        await channels.close()
    finally:
        await server.stop()


async def test_a_server_not_named_as_expected_is_refused(lab: Lab) -> None:
    recorder = Recorder()
    server = await serve(lab.identity("node-b"), recorder)
    try:
        reason = await refusal(lab.identity("node-c"), "node-d", server.port)
        assert "does not name node-d" in reason and recorder.callers == []
    finally:
        await server.stop()


async def test_foreign_ca_and_expired_clients_are_refused(lab: Lab, foreign_lab: Lab) -> None:
    recorder = Recorder()
    server = await serve(lab.identity("node-b"), recorder)
    try:
        await refusal(foreign_lab.identity("node-c"), "node-b", server.port)
        await refusal(lab.identity("node-e", at=time.time() - 3 * DAY, days=1), "node-b", server.port)
        assert recorder.callers == []
    finally:
        await server.stop()


async def test_foreign_ca_and_expired_servers_are_refused(lab: Lab, foreign_lab: Lab) -> None:
    for identity in (
        foreign_lab.identity("node-b"),
        lab.identity("node-b", at=time.time() - 3 * DAY, days=1),
    ):
        recorder = Recorder()
        server = await serve(identity, recorder)
        try:
            reason = await refusal(lab.identity("node-c"), "node-b", server.port)
            print(reason)
            assert "not valid for this lab" in reason or "UNAVAILABLE" in reason
            assert recorder.callers == []
        finally:
            await server.stop()


async def test_a_node_outside_the_allow_list_is_refused_and_logged(
    lab: Lab, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder()
    server = await serve(lab.identity("node-b"), recorder, admit=tls.admit_only(["node-c"]))
    try:
        with caplog.at_level(logging.WARNING):
            await heartbeat(lab.identity("node-c"), "node-b", server.port)
            reason = await refusal(lab.identity("node-d"), "node-b", server.port)
        assert "refused us" in reason and "not in this daemon's list of peers" in reason
        assert recorder.callers == ["node-c"]
        assert any("refused peer call" in r.message and "node-d" in r.message for r in caplog.records)
    finally:
        await server.stop()


async def test_a_handler_refusal_reaches_the_peer(lab: Lab) -> None:
    server = await serve(lab.identity("node-b"), Recorder(refuse="draining"))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await heartbeat(lab.identity("node-c"), "node-b", server.port)
        assert (
            caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            and caught.value.details() == "draining"
        )
        channels = PeerChannels(lab.identity("node-c"))
        stub = channels.stub("node-b", f"127.0.0.1:{server.port}")
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.Handoff(pb.HandoffRequest(), timeout=5)
        assert missing.value.code() is grpc.StatusCode.UNIMPLEMENTED
        await channels.close()
    finally:
        await server.stop()


def test_servers_accept_pings_as_often_as_clients_send_them() -> None:
    keepalive = tls.Keepalive(time_s=2.0, timeout_s=1.0)
    client = dict(keepalive.client_options())
    server = dict(keepalive.server_options())
    assert client["grpc.keepalive_time_ms"] == 2000 and client["grpc.keepalive_permit_without_calls"] == 1
    assert server["grpc.http2.min_recv_ping_interval_without_data_ms"] <= client["grpc.keepalive_time_ms"]
    assert server["grpc.keepalive_permit_without_calls"] == 1


def test_fork_support_is_off_once_federation_is_imported() -> None:
    code = "import os, singularityd.federation.peer; print(os.environ['GRPC_ENABLE_FORK_SUPPORT'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={})
    assert out.stdout.strip() == "0"


async def test_spawning_processes_while_peer_calls_are_in_flight(lab: Lab) -> None:
    """The gRPC-and-fork trap: children that exec at once while calls run must not hang anything."""
    server = await serve(lab.identity("node-b"), Recorder())
    channels = PeerChannels(lab.identity("node-c"))
    stub = channels.stub("node-b", f"127.0.0.1:{server.port}")

    async def calls() -> None:
        for _ in range(100):
            await stub.Heartbeat(pb.HeartbeatRequest(), timeout=10)

    async def spawns() -> None:
        for _ in range(30):
            process = await asyncio.create_subprocess_exec("/bin/true")
            assert await process.wait() == 0

    try:
        await asyncio.wait_for(asyncio.gather(calls(), spawns()), timeout=60)
    finally:
        await channels.close()
        await server.stop()
