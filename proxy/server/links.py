"""The links between the proxy servers of one job: one connection to each other device's server.

The daemon makes a socketpair for every pair of the job's devices and hands each server its ends
(`--peer-fds INDEX:FD,...`), so no other process, the job's included, can reach these links. A
reader thread per link hands every message to the job's collectives (collectives.py); sending
holds the link's lock for a whole frame. Each link counts the messages sent and taken, so the
daemon can tell when none is in flight (a consistent cut, see collectives.Collectives.settle).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from singularity.proxy.bootstrap._singularity_proxy import protocol


class PeerLink:
    """The connection of this server to the server of another of the job's devices."""

    def __init__(self, index: int, sock: socket.socket) -> None:
        self.index = index
        """The job's device index (cuda:index) the other server serves."""
        self.sock = sock
        self.send_lock = threading.Lock()
        self.sent = 0
        """Messages sent (counted before sending)."""
        self.received = 0
        """Messages taken (counted by the collectives once a message has been applied)."""
        self.thread: threading.Thread | None = None

    def send(self, kind: int, body: Any, buffers: Sequence[Any] = ()) -> None:
        """Send one frame whose body is JSON-ready; OSError if the other server is gone."""
        with self.send_lock:
            self.sent += 1
            protocol.send_frame(self.sock, kind, body, buffers)

    def start(
        self, deliver: Callable[[PeerLink, protocol.Frame], None], lost: Callable[[PeerLink], None]
    ) -> None:
        """Read messages in a thread, handing each to `deliver`, and call `lost` when the link ends."""

        def read() -> None:
            try:
                while True:
                    deliver(self, protocol.recv_frame(self.sock, protocol.PEER_FRAME_LIMITS))
            except (OSError, ConnectionError, EOFError, protocol.ProtocolError):
                pass
            finally:
                lost(self)

        self.thread = threading.Thread(target=read, name=f"sing-peer-{self.index}", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Close the connection (the reader then ends)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def parse_peer_fds(text: str) -> dict[int, int]:
    """`INDEX:FD,...` from the command line as {device index: file descriptor}."""
    found: dict[int, int] = {}
    for item in filter(None, text.split(",")):
        index, _, fd = item.partition(":")
        found[int(index)] = int(fd)
    return found
