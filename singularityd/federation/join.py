"""Joining a lab: a new machine gets its node certificate from the CA node, kubeadm style.

The CA node serves the Join service on its own port with server-only TLS (the newcomer has no
certificate yet). The newcomer is told three things: the address, a join token and the CA's
fingerprint. It reads the certificate chain the join port presents, keeps the CA certificate
only if its fingerprint is the expected one, then opens a TLS channel that trusts that CA alone
and names the CA node, and sends a CSR made with a key generated locally, with the token.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio
from cryptography import x509

from singularityd.federation.pki import (
    NodeIdentity,
    Pki,
    PkiError,
    cert_to_pem,
    check_issued_by,
    fingerprint,
    node_name_of,
    same_fingerprint,
)
from singularityd.federation.v1 import peer_pb2 as pb
from singularityd.federation.v1 import peer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class JoinError(RuntimeError):
    """Joining failed; the message (one line) says why."""


class JoinService(pb_grpc.JoinServicer):  # type: ignore[misc]
    """Signs certificate requests that come with a valid join token (CA node only)."""

    def __init__(self, pki: Pki, clock: Callable[[], float] = time.time, peer_address: str = "") -> None:
        self.pki = pki
        self.clock = clock
        self.peer_address = peer_address

    async def Join(
        self, request: pb.JoinRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.JoinReply:
        """Check the token and the CSR; return the node certificate and the CA certificate."""
        try:
            cert, ca = await asyncio.to_thread(
                self.pki.sign_request, request.token, request.csr_pem, self.clock()
            )
        except PkiError as e:
            log.warning("refused a join from %s: %s", context.peer(), e)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
            raise AssertionError("unreachable") from e
        name = node_name_of(x509.load_pem_x509_certificate(cert))
        log.info("certified node %s (join from %s)", name, context.peer())
        return pb.JoinReply(certificate_pem=cert, ca_pem=ca, peer_address=self.peer_address)


async def start_join_server(
    pki: Pki, identity: NodeIdentity, bind: str, peer_address: str = ""
) -> tuple[grpc.aio.Server, int]:
    """Serve Join on `bind` with this node's certificate (chain includes the CA); return server and port.

    `peer_address` (where this node's peer service listens) is told to every node that joins.
    """
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_JoinServicer_to_server(JoinService(pki, peer_address=peer_address), server)
    credentials = grpc.ssl_server_credentials(
        [(identity.key_pem, identity.cert_pem + identity.ca_pem)],
        root_certificates=None,
        require_client_auth=False,
    )
    port = server.add_secure_port(bind, credentials)
    if port == 0:
        raise OSError(f"cannot listen for joins on {bind}")
    await server.start()
    return server, port


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of `host:port` or `[v6]:port`; JoinError when it has no port."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise JoinError(f"{address!r} is not host:port")
    return host.strip("[]"), int(port)


def presented_chain(address: str, timeout_s: float) -> list[bytes]:
    """The DER certificates the TLS server at `address` presents, unverified (checked by the caller)."""
    host, port = split_address(address)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((host, port), timeout=timeout_s) as raw,
        context.wrap_socket(raw, server_hostname=None) as tls,
    ):
        unverified = getattr(tls, "get_unverified_chain", None) or tls._sslobj.get_unverified_chain  # type: ignore[attr-defined]
        chain = unverified() or []
    return [c if isinstance(c, bytes) else c.public_bytes(ssl._ssl.ENCODING_DER) for c in chain]  # type: ignore[attr-defined]


def discover_ca(address: str, expected_fingerprint: str, timeout_s: float = 10.0) -> tuple[bytes, str]:
    """The CA certificate (PEM) with the expected fingerprint, and the node name the join port presents."""
    try:
        chain = [x509.load_der_x509_certificate(der) for der in presented_chain(address, timeout_s)]
    except (OSError, ssl.SSLError, ValueError) as e:
        raise JoinError(f"cannot reach the join port at {address}: {e}") from e
    if not chain:
        raise JoinError(f"{address} presented no certificate")
    matching = [c for c in chain if same_fingerprint(fingerprint(cert_to_pem(c)), expected_fingerprint)]
    if not matching:
        raise JoinError(
            f"{address} does not present a CA with fingerprint {expected_fingerprint}: refusing to join "
            "(the address must be the CA node's join port, its join_port, 7071 unless configured; "
            "`sing cluster token` there prints the whole join line)"
        )
    ca = matching[0]
    try:
        check_issued_by(chain[0], ca)
    except PkiError as e:
        raise JoinError(f"{address} presents a certificate the expected CA did not sign") from e
    return cert_to_pem(ca), node_name_of(chain[0])


async def join(
    pki: Pki, node_name: str, address: str, token: str, ca_fingerprint: str, *, timeout_s: float = 10.0
) -> NodeIdentity:
    """Get this node certified by the CA node at `address`; the private key never leaves this node.

    The CA node's peer address, when it tells one, is remembered as a seed (`Pki.remembered_peers`).
    """
    ca_pem, ca_node = await asyncio.to_thread(discover_ca, address, ca_fingerprint, timeout_s)
    csr = await asyncio.to_thread(pki.join_request, node_name)
    credentials = grpc.ssl_channel_credentials(root_certificates=ca_pem)
    options = [("grpc.ssl_target_name_override", ca_node)]
    async with grpc.aio.secure_channel(address, credentials, options=options) as channel:
        try:
            reply = await pb_grpc.JoinStub(channel).Join(
                pb.JoinRequest(token=token, csr_pem=csr), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as e:
            raise JoinError(f"the CA node refused the join: {e.details()}") from e
    try:
        await asyncio.to_thread(pki.install, reply.certificate_pem, reply.ca_pem, ca_fingerprint, node_name)
        if reply.peer_address:
            await asyncio.to_thread(pki.remember_peer, ca_node, reply.peer_address)
        return await asyncio.to_thread(pki.identity, time.time())
    except PkiError as e:
        raise JoinError(str(e)) from e
