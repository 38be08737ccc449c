"""Checkpoint transfer throughput: gRPC streams against raw sockets, plain and mutual TLS, in one run.

Run: .venv/bin/python bench/bench_transfer.py [--mib 512] [--runs 3]

All over loopback on this machine, so sender and receiver share its cores. Rows:
- raw bytes: a plain TCP socket, a TLS 1.3 socket with the node certificates (mutual), a gRPC
  client stream of Chunk messages (insecure, and mutual TLS as the peer service uses it);
- the real transfer (`transfer_grpc.Sending` -> `Receivers` over mTLS: read files, sha256 per chunk
  on both sides, write files, verify the manifest) from and to /dev/shm, and the same pipeline
  without a network (`transfer.copy_locally`) as its ceiling.
Each figure is the median of the runs, in MB/s (10^6 bytes per second).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import ssl
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
import grpc.aio  # noqa: E402

from singularityd.federation import tls  # noqa: E402
from singularityd.federation.peer import PeerChannels, PeerServer, PeerService  # noqa: E402
from singularityd.federation.pki import NodeIdentity, Pki  # noqa: E402
from singularityd.federation.transfer import Destination, MiB, Source, copy_locally  # noqa: E402
from singularityd.federation.transfer_grpc import Receivers, Sending  # noqa: E402
from singularityd.federation.v1 import peer_pb2 as pb  # noqa: E402
from singularityd.federation.v1 import peer_pb2_grpc as pb_grpc  # noqa: E402


def make_identities(root: Path) -> tuple[NodeIdentity, NodeIdentity]:
    """A lab CA on node-a and a certified node-b."""
    ca = Pki(root / "node-a")
    result = ca.init("bench", "node-a", time.time())
    joiner = Pki(root / "node-b")
    cert, ca_pem = ca.sign_request(str(result.token), joiner.join_request("node-b"), time.time())
    joiner.install(cert, ca_pem, result.ca_fingerprint, "node-b")
    return ca.identity(time.time()), joiner.identity(time.time())


def tls_context(identity: NodeIdentity, root: Path, server: bool) -> ssl.SSLContext:
    """A stdlib TLS context with the node's certificate that requires the peer's (mutual TLS)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    key, cert = root / f"{identity.node_name}.key", root / f"{identity.node_name}.crt"
    key.write_bytes(identity.key_pem)
    cert.write_bytes(identity.cert_pem)
    context.load_cert_chain(cert, key)
    context.load_verify_locations(cadata=identity.ca_pem.decode())
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def raw_socket(total: int, chunk: int, contexts: tuple[ssl.SSLContext, ssl.SSLContext] | None) -> float:
    """MB/s of sendall() of `total` bytes in `chunk` pieces to a reader thread."""
    data = os.urandom(chunk)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    received = [0]

    def reader() -> None:
        conn, _ = listener.accept()
        if contexts is not None:
            conn = contexts[0].wrap_socket(conn, server_side=True)
        buffer = memoryview(bytearray(chunk))
        while received[0] < total:
            n = conn.recv_into(buffer)
            if not n:
                break
            received[0] += n
        conn.close()

    thread = threading.Thread(target=reader)
    thread.start()
    sock: socket.socket = socket.create_connection(("127.0.0.1", port))
    if contexts is not None:
        sock = contexts[1].wrap_socket(sock, server_hostname="node-a")
    start = time.perf_counter()
    for _ in range(total // chunk):
        sock.sendall(data)
    thread.join()
    elapsed = time.perf_counter() - start
    sock.close()
    listener.close()
    assert received[0] == total
    return total / elapsed / 1e6


class Sink(pb_grpc.PeerServicer):  # type: ignore[misc]
    """Counts the bytes of a chunk stream and drops them."""

    async def SendChunks(self, chunks: AsyncIterator[pb.Chunk], context: Any) -> pb.TransferState:
        """Count."""
        held = 0
        async for chunk in chunks:
            held += len(chunk.data)
        return pb.TransferState(bytes_held=held)


async def grpc_stream(total: int, chunk: int, identities: tuple[NodeIdentity, NodeIdentity] | None) -> float:
    """MB/s of one client stream of Chunk messages carrying `total` bytes."""
    data = os.urandom(chunk)
    server = grpc.aio.server(options=tls.MESSAGE_OPTIONS)
    pb_grpc.add_PeerServicer_to_server(Sink(), server)
    if identities is None:
        port = server.add_insecure_port("127.0.0.1:0")
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=tls.MESSAGE_OPTIONS)
    else:
        port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(identities[0]))
        credentials = tls.channel_credentials(identities[1])
        options = tls.client_options("node-a", tls.Keepalive())
        channel = grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials, options=options)
    await server.start()

    async def chunks() -> AsyncIterator[pb.Chunk]:
        for i in range(total // chunk):
            yield pb.Chunk(transfer_id="bench", file=0, index=i, data=data)

    start = time.perf_counter()
    reply = await pb_grpc.PeerStub(channel).SendChunks(chunks())
    elapsed = time.perf_counter() - start
    assert reply.bytes_held == total
    await channel.close(None)
    await server.stop(None)
    return total / elapsed / 1e6


def make_source_dir(root: Path, total: int) -> Path:
    """A checkpoint-like directory of `total` bytes: one big image, a device-state file, small files."""
    root.mkdir(parents=True)
    (root / "images").mkdir()
    block = os.urandom(16 * MiB)
    with open(root / "images" / "pages-1.img", "wb") as handle:
        for _ in range(total * 3 // 4 // len(block)):
            handle.write(block)
    (root / "dev-0.state").write_bytes(os.urandom(total // 4))
    for i in range(20):
        (root / "images" / f"core-{i}.img").write_bytes(os.urandom(4096))
    return root


async def real_transfer(
    src: Path, work: Path, chunk: int, identities: tuple[NodeIdentity, NodeIdentity]
) -> float:
    """MB/s of the full transfer over the mTLS peer service into `work`."""
    dest = work / "incoming"
    receivers = Receivers(lambda node, job, epoch: dest)
    server = PeerServer(identities[0], "127.0.0.1:0", PeerService(transfers=receivers))
    port = await server.start()
    channels = PeerChannels(identities[1])
    source = Source(src, chunk)
    sending = Sending(channels.stub("node-a", f"127.0.0.1:{port}"), source, "bench@1", "bench", 1)
    start = time.perf_counter()
    await sending.run(attempts=1)
    elapsed = time.perf_counter() - start
    await channels.close()
    await server.stop(0)
    shutil.rmtree(dest)
    return source.total / elapsed / 1e6


def local_pipeline(src: Path, work: Path, chunk: int) -> float:
    """MB/s of read + hash + hash + write with no network (the transfer's own ceiling)."""
    source = Source(src, chunk)
    start = time.perf_counter()
    assert copy_locally(source, Destination(work / "local", source.entries, chunk)) == []
    elapsed = time.perf_counter() - start
    shutil.rmtree(work / "local")
    return source.total / elapsed / 1e6


def measures(
    total: int,
    chunk: int,
    src: Path,
    work: Path,
    identities: tuple[NodeIdentity, NodeIdentity],
    contexts: tuple[ssl.SSLContext, ssl.SSLContext],
) -> dict[str, Callable[[], float]]:
    """Each row of the table, as a function measuring it once with `chunk`-sized pieces."""
    return {
        "raw socket, plain": lambda: raw_socket(total, chunk, None),
        "raw socket, mutual TLS": lambda: raw_socket(total, chunk, contexts),
        "gRPC stream, insecure": lambda: asyncio.run(grpc_stream(total, chunk, None)),
        "gRPC stream, mutual TLS": lambda: asyncio.run(grpc_stream(total, chunk, identities)),
        "transfer over gRPC mTLS (files, sha256 both sides)": lambda: asyncio.run(
            real_transfer(src, work, chunk, identities)
        ),
        "same pipeline, no network (ceiling)": lambda: local_pipeline(src, work, chunk),
    }


def median(runs: int, measure: Callable[[], float]) -> float:
    """The median of `runs` measurements."""
    return statistics.median(measure() for _ in range(runs))


def main() -> None:
    """Measure every row for 1 MiB and 4 MiB chunks and print a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=512, help="bytes to move per measurement, in MiB")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    total = args.mib * MiB
    with tempfile.TemporaryDirectory(prefix="bench-transfer-", dir="/dev/shm") as tmp:
        root = Path(tmp)
        identities = make_identities(root / "pki")
        contexts = (tls_context(identities[0], root, True), tls_context(identities[1], root, False))
        src = make_source_dir(root / "src", total)
        rows: dict[str, dict[int, float]] = {}
        for chunk in (1 * MiB, 4 * MiB):
            for name, measure in measures(total, chunk, src, root, identities, contexts).items():
                rows.setdefault(name, {})[chunk] = median(args.runs, measure)
    print(f"{args.mib} MiB per run, median of {args.runs}, loopback, {os.cpu_count()} CPUs\n")
    print("| path | 1 MiB chunks MB/s | 4 MiB chunks MB/s |")
    print("|---|---:|---:|")
    for name, by_chunk in rows.items():
        print(f"| {name} | {by_chunk[1 * MiB]:.0f} | {by_chunk[4 * MiB]:.0f} |")
    tls_raw, tls_grpc = rows["raw socket, mutual TLS"], rows["gRPC stream, mutual TLS"]
    full = rows["transfer over gRPC mTLS (files, sha256 both sides)"]
    for chunk in (1 * MiB, 4 * MiB):
        print(
            f"\n{chunk // MiB} MiB chunks: gRPC/raw over mutual TLS {tls_grpc[chunk] / tls_raw[chunk]:.2f}; "
            f"full transfer / raw mutual TLS {full[chunk] / tls_raw[chunk]:.2f}; "
            f"1 GiB takes {2**30 / 1e6 / full[chunk]:.2f} s over the transfer"
        )


if __name__ == "__main__":
    main()
