"""A peer node for the network-namespace tests: serves the peer service and runs commands from stdin.

Run inside a namespace: `python -m tests.federation.peer_node --pki DIR --listen ADDR:PORT ...`.
It prints JSON lines on stdout: {"event": "ready"} once listening, then one or more lines per
command. Commands are JSON lines on stdin:

    {"op": "heartbeat", "node": N, "address": A}  -> {"event": "heartbeat", "ok", "error"}
    {"op": "watch", "node": N, "address": A}      -> {"event": "watching"} .. {"event": "watch-ended"}
    {"op": "send", "node", "address", "dir", "job", "epoch"}
                                                  -> {"event": "progress", ...} .. {"event": "sent"}
    {"op": "peers"}                               -> {"event": "peers", "peers": {node: {"state", "error"}}}

With --seed, it heartbeats with its peers in the background (membership as the daemon keeps it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from singularityd.federation import tls
from singularityd.federation.heartbeat import Heartbeats
from singularityd.federation.membership import Membership, PeerStatus, Seed, Timing, parse_seed
from singularityd.federation.peer import SERVICE_NAME, PeerChannels, PeerServer, PeerService
from singularityd.federation.pki import NodeIdentity, Pki, node_name_of
from singularityd.federation.transfer import MiB, Progress, Source, TransferError
from singularityd.federation.transfer_grpc import Receivers, Sending


def emit(**event: Any) -> None:
    """Print one JSON event line."""
    print(json.dumps(event), flush=True)


async def watch(channels: PeerChannels, node: str, address: str) -> None:
    """Hold an idle health Watch stream open until it breaks; report when it does."""
    stub = health_pb2_grpc.HealthStub(channels.channel(node, address))
    try:
        async for reply in stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME)):
            emit(event="watching", status=int(reply.status))
        emit(event="watch-ended", error="stream ended")
    except grpc.aio.AioRpcError as e:
        emit(event="watch-ended", error=f"{e.code().name}: {e.details()}")


async def send(channels: PeerChannels, command: dict[str, Any]) -> None:
    """Send a directory, reporting progress; resume across broken links."""

    def progress(p: Progress) -> None:
        emit(event="progress", phase=p.phase, moved=p.moved, total=p.total, sent=p.sent)

    source = Source(Path(command["dir"]), MiB)
    stub = channels.stub(command["node"], command["address"])
    transfer_id = f"{command['job']}@{command['epoch']}"
    sending = Sending(stub, source, transfer_id, command["job"], int(command["epoch"]), progress)
    try:
        await sending.run(
            attempts=int(command.get("attempts", 60)), pause_s=float(command.get("pause_s", 0.5))
        )
        emit(event="sent", ok=True, sent=sending.sent, total=source.total)
    except TransferError as e:
        emit(event="sent", ok=False, error=str(e))


async def main() -> None:
    """Serve, then run the commands read from stdin until it closes."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--pki", type=Path, required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--receive-into", type=Path)
    parser.add_argument("--unchecked", action="store_true", help="use the PKI files as they are (bad peers)")
    parser.add_argument("--seed", action="append", default=[], help="node@host:port to heartbeat with")
    parser.add_argument("--heartbeat-interval", type=float, default=0.5)
    parser.add_argument("--keepalive-time", type=float, default=1.0)
    parser.add_argument("--keepalive-timeout", type=float, default=1.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    pki = Pki(args.pki)
    if args.unchecked:
        key, cert = pki.node_key_path.read_bytes(), pki.node_cert_path.read_bytes()
        name = node_name_of(x509.load_pem_x509_certificate(cert))
        identity = NodeIdentity(name, key, cert, pki.ca_cert_path.read_bytes(), not_after=0.0)
    else:
        identity = pki.identity(time.time())
    keepalive = tls.Keepalive(args.keepalive_time, args.keepalive_timeout)
    i = args.heartbeat_interval
    timing = Timing(
        interval_s=i, suspect_after_s=3 * i, dead_after_s=6 * i, dead_retry_s=4 * i, seed_retry_s=2 * i
    )
    membership = Membership.from_seeds(
        identity.node_name, [parse_seed(s) for s in args.seed], time.time(), timing
    )
    channels = PeerChannels(identity, keepalive)
    status = PeerStatus(identity.node_name, args.listen, "test")
    receive_into = args.receive_into

    def authorize(node: str, job: str, epoch: int) -> Path:
        assert receive_into is not None
        return Path(receive_into) / f"{job}@{epoch}"

    beats = Heartbeats(membership, channels, lambda: status)
    service = PeerService(
        heartbeats=beats,
        transfers=Receivers(authorize) if receive_into else None,
    )
    server = PeerServer(identity, args.listen, service, keepalive=keepalive)
    await server.start()
    emit(event="ready", node=identity.node_name)

    stop = asyncio.Event()
    heartbeats = asyncio.create_task(beats.run(stop))
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[str | None] = asyncio.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(commands.put_nowait, line)
        loop.call_soon_threadsafe(commands.put_nowait, None)

    threading.Thread(target=read_stdin, daemon=True).start()
    tasks: set[asyncio.Task[None]] = set()
    while (line := await commands.get()) is not None:
        command = json.loads(line)
        match command["op"]:
            case "heartbeat":
                peer = Seed(command["node"], command["address"])
                membership.learn([peer], time.time())
                ok = await beats.contact(peer)
                emit(event="heartbeat", ok=ok, error=membership.members[peer.node].last_error)
            case "watch":
                tasks.add(asyncio.create_task(watch(channels, command["node"], command["address"])))
            case "send":
                tasks.add(asyncio.create_task(send(channels, command)))
            case "peers":
                rows = membership.view(time.time())
                emit(event="peers", peers={r.node: {"state": str(r.state), "error": r.error} for r in rows})
    stop.set()
    await heartbeats
    for task in tasks:
        task.cancel()
    await channels.close()
    await server.stop(0)


if __name__ == "__main__":
    asyncio.run(main())
