"""Who is calling: taken from the kernel (SO_PEERCRED), never from a request field.

gRPC does not tell a server which Unix user connected, so the daemon accepts connections on
the public socket itself, reads the peer's credentials, and relays the bytes to a private gRPC
server bound to that user. Each such server knows its caller, so every request is attributed
by the kernel's word.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import pwd
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

RELAY_CHUNK = 256 * 1024
PIPE_END_SECONDS = 5.0
"""How long a stopping relay waits for the connections it closed to end before cancelling them (a
cancelled handler makes asyncio log a CancelledError traceback)."""


@dataclass(frozen=True)
class Caller:
    """The user behind a connection, as the kernel reported it.

    The group and admin rights are looked up at each use, so a change in the group database
    takes effect without restarting the daemon.
    """

    uid: int
    user: str
    connection_gid: int
    admin_group: str

    @property
    def gid(self) -> int:
        """The user's primary group (from the account database; else the connection's)."""
        try:
            return pwd.getpwuid(self.uid).pw_gid
        except KeyError:
            return self.connection_gid

    @property
    def is_admin(self) -> bool:
        """Root, or a member of the admin group."""
        return self.uid == 0 or self.in_group(self.admin_group)

    def in_group(self, name: str) -> bool:
        """Whether the user belongs to the named group (primary or supplementary; no name, or a
        group that does not exist: no)."""
        if not name:
            return False
        try:
            group = grp.getgrnam(name)
        except KeyError:
            return False
        try:
            groups = set(os.getgrouplist(self.user, self.gid))
        except OSError:
            groups = {self.gid}
        return self.user in group.gr_mem or group.gr_gid in groups

    def may_act_on(self, owner_uid: int) -> bool:
        """Users act on their own jobs; root and admins on any."""
        return self.uid == owner_uid or self.is_admin


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def resolve_caller(uid: int, gid: int, admin_group: str) -> Caller:
    """Name the user of a uid the kernel reported."""
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    return Caller(uid=uid, user=user, connection_gid=gid, admin_group=admin_group)


class IdentityRelay:
    """Accept on the public socket, learn the peer's uid, pipe the bytes to that uid's server."""

    def __init__(
        self,
        public_socket: Path,
        server_for_uid: Callable[[int, int], Awaitable[Path]],
        allowed_uids: frozenset[int] | None,
        socket_mode: int,
    ) -> None:
        self.public_socket = public_socket
        self.server_for_uid = server_for_uid
        self.allowed_uids = allowed_uids
        self.socket_mode = socket_mode
        self._server: asyncio.Server | None = None
        self._pipes: dict[asyncio.Task[None], tuple[asyncio.StreamWriter, ...]] = {}
        """Each connection being piped: its handler's task and the streams of both its sides."""

    async def start(self) -> None:
        """Bind the public socket (replacing a stale one) with the configured permissions."""
        with contextlib.suppress(FileNotFoundError):
            self.public_socket.unlink()
        self._server = await asyncio.start_unix_server(
            self._accept, path=str(self.public_socket), limit=RELAY_CHUNK
        )
        os.chmod(self.public_socket, self.socket_mode)

    async def stop(self) -> None:
        """Stop accepting and close the relayed connections, letting their handlers end on their own."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        for streams in list(self._pipes.values()):
            for stream in streams:
                stream.close()
        if self._pipes:
            _, stuck = await asyncio.wait(list(self._pipes), timeout=PIPE_END_SECONDS)
            for task in stuck:
                task.cancel()
        with contextlib.suppress(FileNotFoundError):
            self.public_socket.unlink()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        try:
            _, uid, gid = peer_credentials(sock)
            if self.allowed_uids is not None and uid not in self.allowed_uids:
                log.warning("refused a connection from uid %d (user-mode daemon)", uid)
                writer.close()
                return
            target = await self.server_for_uid(uid, gid)
            upstream_reader, upstream_writer = await asyncio.open_unix_connection(
                str(target), limit=RELAY_CHUNK
            )
        except (OSError, ValueError) as error:
            log.warning("relay failed to connect a client: %s", error)
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None
        self._pipes[task] = (writer, upstream_writer)
        try:
            await asyncio.gather(
                _pipe(reader, upstream_writer), _pipe(upstream_reader, writer), return_exceptions=True
            )
        finally:
            self._pipes.pop(task, None)
            for stream in (writer, upstream_writer):
                stream.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy bytes one way until EOF, then half-close the other side."""
    try:
        while data := await reader.read(RELAY_CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()
