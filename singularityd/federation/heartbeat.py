"""Heartbeats: the driver that keeps `Membership` current by exchanging status with peers.

Both directions count: when we call a peer, and when a peer calls us, each side learns the
other's devices, free capacity, version and the peers it knows. A caller that claims another
node's name than its certificate's is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import grpc.aio

from singularityd.federation import tls
from singularityd.federation.membership import DeviceInfo, Membership, PeerStatus, Seed
from singularityd.federation.peer import PeerChannels, Refused
from singularityd.federation.v1 import peer_pb2 as pb

log = logging.getLogger(__name__)


def status_to_pb(status: PeerStatus) -> pb.NodeStatus:
    """A PeerStatus as the wire message."""
    return pb.NodeStatus(
        node=status.node,
        address=status.address,
        version=status.version,
        devices=[
            pb.Device(index=d.index, kind=d.kind, name=d.name, memory_total=d.memory_total, free=d.free)
            for d in status.devices
        ],
        free_devices=status.free_devices,
        draining=status.draining,
        running_jobs=status.running_jobs,
    )


def status_from_pb(message: pb.NodeStatus) -> PeerStatus:
    """The wire message as a PeerStatus."""
    return PeerStatus(
        node=message.node,
        address=message.address,
        version=message.version,
        devices=tuple(DeviceInfo(d.index, d.kind, d.name, d.memory_total, d.free) for d in message.devices),
        free_devices=message.free_devices,
        draining=message.draining,
        running_jobs=message.running_jobs,
    )


def seeds_to_pb(seeds: list[Seed]) -> list[pb.PeerAddress]:
    """Known peers as wire messages."""
    return [pb.PeerAddress(node=s.node, address=s.address) for s in seeds]


@dataclass
class Heartbeats:
    """Contacts due peers every interval and answers peers' heartbeats (a HeartbeatHandler)."""

    membership: Membership
    channels: PeerChannels
    local_status: Callable[[], PeerStatus]
    clock: Callable[[], float] = time.time
    timeout_s: float = 5.0
    _refusals_logged: set[str] = field(default_factory=set)
    _exchanges: dict[str, asyncio.Task[bool]] = field(default_factory=dict)

    async def heartbeat(self, node: str, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        """A peer called us: record it (its claimed name must be its certificate's), answer with ours."""
        claimed = request.sender.node
        if claimed != node:
            raise Refused(f"the heartbeat claims to come from {claimed!r} but the certificate names {node!r}")
        now = self.clock()
        self.membership.heard_from(status_from_pb(request.sender), now)
        self.membership.learn((Seed(p.node, p.address) for p in request.known if p.node and p.address), now)
        return pb.HeartbeatReply(
            status=status_to_pb(self.local_status()), known=seeds_to_pb(self.membership.known())
        )

    async def contact(self, peer: Seed) -> bool:
        """One exchange with `peer`; return whether it answered as itself."""
        request = pb.HeartbeatRequest(
            sender=status_to_pb(self.local_status()), known=seeds_to_pb(self.membership.known())
        )
        try:
            reply = await self.channels.stub(peer.node, peer.address).Heartbeat(
                request, timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as e:
            reason = tls.describe_failure(e, peer.node, peer.address)
            if reason.startswith("refused") and reason not in self._refusals_logged:
                self._refusals_logged.add(reason)
                log.warning("%s", reason)
            self.membership.contact_failed(peer.node, reason, self.clock())
            return False
        status = status_from_pb(reply.status)
        now = self.clock()
        if status.node != peer.node:  # TLS already checked the name; a reply naming another is a bug there
            self.membership.contact_failed(peer.node, f"answered as {status.node!r}", now)
            return False
        self.membership.heard_from(status, now)
        self.membership.learn((Seed(p.node, p.address) for p in reply.known if p.node and p.address), now)
        return True

    def launch_due(self) -> list[asyncio.Task[bool]]:
        """Start an exchange with every due peer not still in one, without waiting for any: a peer
        slow to answer (hung, behind a dropped link) holds back no other peer's heartbeat."""
        started = []
        for peer in self.membership.due(self.clock()):
            if peer.node in self._exchanges:
                continue
            task = asyncio.create_task(self.contact(peer))
            self._exchanges[peer.node] = task
            task.add_done_callback(functools.partial(self._ended, peer.node))
            started.append(task)
        return started

    def _ended(self, node: str, _: asyncio.Task[bool]) -> None:
        self._exchanges.pop(node, None)

    async def round(self) -> list[bool]:
        """Contact every peer that is due, all at once, and wait for their answers."""
        return list(await asyncio.gather(*self.launch_due()))

    async def run(self, stop: asyncio.Event) -> None:
        """Start the due exchanges every heartbeat interval until `stop` is set."""
        try:
            while not stop.is_set():
                self.launch_due()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=self.membership.timing.interval_s)
        finally:
            pending = list(self._exchanges.values())
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
