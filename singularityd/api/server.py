"""Serving the API: the public socket, and one private gRPC server per connecting user.

The identity relay (singularityd.identity) accepts on the public socket and learns each peer's
uid from the kernel; the first connection of a uid starts a gRPC server bound to that caller on
a private socket, and the relay pipes the bytes through. So every request is attributed by the
kernel's word, never by a field in the request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import grpc

from singularityd.api.protocol import JobService
from singularityd.api.service import SingularityService, add_service
from singularityd.config import Config
from singularityd.identity import IdentityRelay, resolve_caller


class ApiServer:
    """The public socket and the per-user gRPC servers behind it."""

    def __init__(self, jobs: JobService, config: Config) -> None:
        self.jobs = jobs
        self.config = config
        self._servers: dict[int, grpc.aio.Server] = {}
        self._services: dict[int, SingularityService] = {}
        self._lock = asyncio.Lock()
        self._relay = IdentityRelay(
            config.socket,
            self._server_for_uid,
            frozenset({os.geteuid()}) if config.user_mode else None,
            0o600 if config.user_mode else 0o666,
        )

    def reconfigure(self, config: Config) -> None:
        """Take a reloaded config: its admin group and shutdown grace (the socket stays)."""
        self.config = config
        for service in self._services.values():
            service.caller = dataclasses.replace(service.caller, admin_group=config.admin_group)

    async def start(self) -> None:
        """Bind the public socket; servers start as users connect."""
        await self._relay.start()

    async def stop(self) -> None:
        """Stop accepting, give requests in flight the grace period, remove the private sockets."""
        await self._relay.stop()
        grace = self.config.shutdown_grace_seconds
        await asyncio.gather(*(server.stop(grace) for server in self._servers.values()))
        for path in self.config.internal_socket_dir.glob("*.sock"):
            path.unlink(missing_ok=True)

    async def _server_for_uid(self, uid: int, gid: int) -> Path:
        """The private gRPC server that serves requests from this uid, started on first use."""
        path = self.config.internal_socket_dir / f"uid-{uid}.sock"
        async with self._lock:
            if uid not in self._servers:
                caller = resolve_caller(uid, gid, self.config.admin_group)
                server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
                self._services[uid] = add_service(server, self.jobs, caller)
                path.unlink(missing_ok=True)
                server.add_insecure_port(f"unix:{path}")
                await server.start()
                self._servers[uid] = server
        return path
