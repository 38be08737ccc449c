"""Mutual TLS between peers: credentials, keepalive settings, and the node-name check on both sides.

A certificate signed by the lab CA only proves membership of the lab. Each side also checks that
the other is the node it meant to talk to: the client by naming the expected node as the TLS
target (gRPC then verifies the server certificate's name against it), the server by reading the
client's node name from `context.auth_context()` and asking a policy whether that node may call.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

from singularityd.federation.pki import NodeIdentity

log = logging.getLogger(__name__)

MiB = 1 << 20
MAX_MESSAGE_BYTES = 8 * MiB
RECONNECT_BACKOFF_MAX_MS = 10_000


@dataclass(frozen=True)
class Keepalive:
    """HTTP/2 keepalive: clients ping every `time_s`; a ping unanswered in `timeout_s` drops the link.

    Servers permit pings as often as `time_s` even without calls in flight, so they never answer a
    client's pings with "too_many_pings".
    """

    time_s: float = 20.0
    timeout_s: float = 10.0

    def client_options(self) -> list[tuple[str, Any]]:
        """Channel options for a client that pings."""
        return [
            ("grpc.keepalive_time_ms", int(self.time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]

    def server_options(self) -> list[tuple[str, Any]]:
        """Server options that accept the clients' pings and ping idle clients in turn."""
        interval_ms = int(self.time_s * 1000)
        return [
            ("grpc.keepalive_time_ms", interval_ms),
            ("grpc.keepalive_timeout_ms", int(self.timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", min(interval_ms, 5000)),
            ("grpc.http2.min_ping_interval_without_data_ms", min(interval_ms, 5000)),
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.http2.max_pings_without_data", 0),
        ]


MESSAGE_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def server_credentials(identity: NodeIdentity) -> grpc.ServerCredentials:
    """TLS for the peer server: our certificate, and clients must present one from the lab CA."""
    return grpc.ssl_server_credentials(
        [(identity.key_pem, identity.cert_pem)],
        root_certificates=identity.ca_pem,
        require_client_auth=True,
    )


def channel_credentials(identity: NodeIdentity) -> grpc.ChannelCredentials:
    """TLS for a client: trust only the lab CA, and present our own certificate."""
    return grpc.ssl_channel_credentials(identity.ca_pem, identity.key_pem, identity.cert_pem)


def client_options(expected_node: str, keepalive: Keepalive) -> list[tuple[str, Any]]:
    """Channel options that make gRPC check the server certificate names `expected_node`."""
    return [
        ("grpc.ssl_target_name_override", expected_node),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS),
        *keepalive.client_options(),
        *MESSAGE_OPTIONS,
    ]


def peer_node_name(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
    """The node the caller's certificate names (CN, which must also be its DNS SAN), or None."""
    auth = context.auth_context()
    common = list(auth.get("x509_common_name") or [])
    sans = list(auth.get("x509_subject_alternative_name") or [])
    if len(common) != 1:
        return None
    name = common[0].decode()
    return name if name.encode() in sans else None


def describe_failure(error: grpc.aio.AioRpcError, node: str, address: str) -> str:
    """One line saying why a call to a peer failed, naming refusals of its certificate plainly."""
    details = error.details() or ""
    if "Hostname Verification" in details or "No match found for server name" in details:
        return f"refused {address}: its certificate does not name {node}"
    if "CERTIFICATE_VERIFY_FAILED" in details or "certificate verify failed" in details:
        return f"refused {address}: its certificate is not valid for this lab ({details})"
    if error.code() is grpc.StatusCode.PERMISSION_DENIED:
        return f"{node} at {address} refused us: {details}"
    return f"{node} at {address}: {error.code().name}: {details}"


Admit = Callable[[str], str]
"""A policy: the reason a node may not call us, or '' when it may."""


def admit_any(node: str) -> str:
    """Admit every node the lab CA certified."""
    return ""


def admit_only(nodes: Sequence[str]) -> Admit:
    """Admit only the named nodes (an allow-list in the configuration)."""
    allowed = frozenset(nodes)

    def admit(node: str) -> str:
        return "" if node in allowed else f"node {node!r} is not in this daemon's list of peers"

    return admit


if TYPE_CHECKING:
    InterceptorBase = grpc.aio.ServerInterceptor[Any, Any]
else:
    InterceptorBase = grpc.aio.ServerInterceptor


class NodeNameInterceptor(InterceptorBase):
    """Refuses (and logs) every call whose client certificate names no node, or one `admit` rejects."""

    def __init__(self, admit: Admit = admit_any) -> None:
        self.admit = admit

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        """Wrap the method's handler so that it checks the caller before running."""
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method

        async def refusal(context: grpc.aio.ServicerContext[Any, Any]) -> None:
            node = peer_node_name(context)
            reason = "the client certificate names no node" if node is None else self.admit(node)
            if reason:
                log.warning("refused peer call %s from %s (%s): %s", method, node, context.peer(), reason)
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)

        return _wrap(handler, refusal)


def _wrap(
    handler: grpc.RpcMethodHandler[Any, Any],
    check: Callable[[grpc.aio.ServicerContext[Any, Any]], Awaitable[None]],
) -> grpc.RpcMethodHandler[Any, Any]:
    """The same handler, with `check(context)` awaited before its behaviour."""
    serial = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: Any) -> Any:
            await check(context)
            return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **serial)
    if handler.stream_unary is not None:
        inner_su = handler.stream_unary

        async def stream_unary(requests: Any, context: Any) -> Any:
            await check(context)
            return await inner_su(requests, context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, **serial)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_streaming(handler.unary_stream, check), **serial)
    assert handler.stream_stream is not None
    return grpc.stream_stream_rpc_method_handler(_streaming(handler.stream_stream, check), **serial)


def _streaming(
    inner: Callable[..., Any], check: Callable[[grpc.aio.ServicerContext[Any, Any]], Awaitable[None]]
) -> Callable[..., Any]:
    """Wrap a response-streaming behaviour of either style (async generator, or context.write)."""
    if inspect.isasyncgenfunction(inner):

        async def generator(request: Any, context: Any) -> Any:
            await check(context)
            async for item in inner(request, context):
                yield item

        return generator

    async def writer(request: Any, context: Any) -> Any:
        await check(context)
        return await inner(request, context)

    return writer
