"""The peer gRPC server (mutual TLS, node-name check, health checking, keepalive) and channels to peers.

The server only adapts the Peer service to the handlers the daemon supplies (heartbeats,
hand-off steps, transfers, job listings); each handler gets the caller's node name as proven by its
certificate, never as a field of the request. The standard gRPC health service runs beside it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from singularityd.federation import tls
from singularityd.federation.pki import NodeIdentity
from singularityd.federation.v1 import peer_pb2 as pb
from singularityd.federation.v1 import peer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "singularity.peer.v1.Peer"

Context = grpc.aio.ServicerContext[Any, Any]
H = TypeVar("H")
R = TypeVar("R")


class Refused(Exception):
    """A handler refuses a request; the message (one line) goes back to the peer."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class DataLoss(Refused):
    """Data arrived damaged (a chunk failing its checksum): the sender may try again."""

    code = grpc.StatusCode.DATA_LOSS


class HeartbeatHandler(Protocol):
    """Answers a peer's heartbeat (see `heartbeat.Heartbeats`)."""

    async def heartbeat(self, node: str, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        """Record what `node` says about itself and answer with our own status."""
        ...


class HandoffHandler(Protocol):
    """Feeds a peer's hand-off request to the hand-off machine and answers with its Reply."""

    async def handoff(self, node: str, request: pb.HandoffRequest) -> pb.HandoffReply:
        """Handle one hand-off step sent by `node`."""
        ...


class TransferHandler(Protocol):
    """Receives checkpoints (see `transfer.Receivers`)."""

    async def begin(self, node: str, request: pb.BeginTransferRequest) -> pb.TransferState:
        """Open or reopen a transfer from `node`; say which chunks are already here."""
        ...

    async def receive(self, node: str, chunks: AsyncIterator[pb.Chunk]) -> pb.TransferState:
        """Store a stream of chunks from `node`."""
        ...

    async def finish(self, node: str, request: pb.FinishTransferRequest) -> pb.TransferVerdict:
        """Check a transfer from `node` against its manifest."""
        ...


class JobsHandler(Protocol):
    """Lists the jobs this node owns, for a peer's `sing ps --cluster`."""

    async def list_jobs(self, node: str, request: pb.ListPeerJobsRequest) -> pb.ListPeerJobsReply:
        """The jobs owned here (ended ones too when asked)."""
        ...


@dataclass
class PeerService(pb_grpc.PeerServicer):  # type: ignore[misc]
    """The Peer service: identifies the caller, then hands the request to the daemon's handler."""

    heartbeats: HeartbeatHandler | None = None
    handoffs: HandoffHandler | None = None
    transfers: TransferHandler | None = None
    jobs: JobsHandler | None = None

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Context) -> pb.HeartbeatReply:
        """See HeartbeatHandler."""
        handler = await _require(self.heartbeats, context)
        return await _call(context, lambda node: handler.heartbeat(node, request))

    async def Handoff(self, request: pb.HandoffRequest, context: Context) -> pb.HandoffReply:
        """See HandoffHandler."""
        handler = await _require(self.handoffs, context)
        return await _call(context, lambda node: handler.handoff(node, request))

    async def BeginTransfer(self, request: pb.BeginTransferRequest, context: Context) -> pb.TransferState:
        """See TransferHandler.begin."""
        handler = await _require(self.transfers, context)
        return await _call(context, lambda node: handler.begin(node, request))

    async def SendChunks(self, requests: AsyncIterator[pb.Chunk], context: Context) -> pb.TransferState:
        """See TransferHandler.receive."""
        handler = await _require(self.transfers, context)
        return await _call(context, lambda node: handler.receive(node, requests))

    async def FinishTransfer(self, request: pb.FinishTransferRequest, context: Context) -> pb.TransferVerdict:
        """See TransferHandler.finish."""
        handler = await _require(self.transfers, context)
        return await _call(context, lambda node: handler.finish(node, request))

    async def ListJobs(self, request: pb.ListPeerJobsRequest, context: Context) -> pb.ListPeerJobsReply:
        """See JobsHandler."""
        handler = await _require(self.jobs, context)
        return await _call(context, lambda node: handler.list_jobs(node, request))


async def _require(handler: H | None, context: Context) -> H:
    if handler is None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this daemon does not serve that yet")
        raise AssertionError("unreachable")
    return handler


async def _call(context: Context, work: Callable[[str], Awaitable[R]]) -> R:
    node = tls.peer_node_name(context)
    if node is None:  # the interceptor refuses these first; this keeps handlers from ever seeing None
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "the client certificate names no node")
        raise AssertionError("unreachable")
    try:
        result = await work(node)
    except Refused as e:
        log.warning("refused a request from %s: %s", node, e)
        await context.abort(e.code, str(e))
        raise AssertionError("unreachable") from e
    return result


@dataclass
class PeerServer:
    """The daemon's listener for peers: TCP, mutual TLS, refusals logged, health service beside."""

    identity: NodeIdentity
    bind: str
    service: PeerService
    admit: tls.Admit = tls.admit_any
    keepalive: tls.Keepalive = field(default_factory=tls.Keepalive)
    port: int = 0
    health: HealthServicer = field(default_factory=HealthServicer)
    _server: grpc.aio.Server | None = None

    async def start(self) -> int:
        """Listen on `bind` (host:port, port 0 picks one) and return the port."""
        server = grpc.aio.server(
            interceptors=[tls.NodeNameInterceptor(self.admit)],
            options=[("grpc.so_reuseport", 0), *self.keepalive.server_options(), *tls.MESSAGE_OPTIONS],
        )
        pb_grpc.add_PeerServicer_to_server(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.port = server.add_secure_port(self.bind, tls.server_credentials(self.identity))
        if self.port == 0:
            raise OSError(f"cannot listen for peers on {self.bind}")
        await server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        host = self.bind.rsplit(":", 1)[0]
        log.info("listening for peers on %s:%d as %s", host, self.port, self.identity.node_name)
        return self.port

    async def stop(self, grace_s: float = 1.0) -> None:
        """Say NOT_SERVING, then stop, letting calls in flight finish for `grace_s`."""
        if self._server is None:
            return
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace_s)
        self._server = None


class PeerChannels:
    """One mutual-TLS channel per peer, each checking that the server's certificate names that peer."""

    def __init__(self, identity: NodeIdentity, keepalive: tls.Keepalive | None = None) -> None:
        self.identity = identity
        self.keepalive = keepalive or tls.Keepalive()
        self._channels: dict[str, tuple[str, grpc.aio.Channel]] = {}
        self._retired: set[asyncio.Task[None]] = set()

    def channel(self, node: str, address: str) -> grpc.aio.Channel:
        """The channel to `node` at `address` (a new one when its address changed)."""
        known = self._channels.get(node)
        if known is not None and known[0] == address:
            return known[1]
        if known is not None:
            self._closing(known[1])
        channel = grpc.aio.secure_channel(
            address, tls.channel_credentials(self.identity), options=tls.client_options(node, self.keepalive)
        )
        self._channels[node] = (address, channel)
        return channel

    def stub(self, node: str, address: str) -> pb_grpc.PeerStub:
        """A Peer client for `node` at `address`."""
        return pb_grpc.PeerStub(self.channel(node, address))

    async def healthy(self, node: str, address: str, timeout_s: float = 5.0) -> bool:
        """Whether `node` answers the standard health check with SERVING."""
        stub = health_pb2_grpc.HealthStub(self.channel(node, address))
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            log.info("health check of %s: %s", node, tls.describe_failure(e, node, address))
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    async def drop(self, node: str) -> None:
        """Close the channel to `node` (the next call reconnects)."""
        known = self._channels.pop(node, None)
        if known is not None:
            await known[1].close(None)

    async def close(self) -> None:
        """Close every channel."""
        for node in list(self._channels):
            await self.drop(node)

    def _closing(self, channel: grpc.aio.Channel) -> None:
        task = asyncio.get_running_loop().create_task(channel.close(None))
        self._retired.add(task)
        task.add_done_callback(self._retired.discard)
