"""Connecting `sing` to singularityd: finding the socket and turning RPC failures into CliErrors."""

from __future__ import annotations

import os
import stat
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from singularity.cli.config import settings
from singularity.cli.errors import EXIT_UNAVAILABLE, CliError, exit_code_for_status
from singularityd.api.v1 import singularity_pb2_grpc as pb_grpc

SYSTEM_SOCKET = Path("/run/singularity/sing.sock")
MAX_REPLY_BYTES = 1 << 30
"""Largest answer taken from the daemon (gRPC's 4 MiB default failed `sing ps` of many long commands)."""
SYSTEM_CONFIG = Path("/etc/singularity/singularityd.toml")
START_HINT = (
    "start it with `sudo systemctl start singularityd`, or `scripts/daemon` from a checkout "
    "(or point SING_SOCKET / --socket at a running one)"
)


def _user_socket() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "singularity" if runtime else Path(f"/tmp/singularity-{os.geteuid()}")
    return base / "sing.sock"


def _config_socket() -> Path | None:
    path = Path(os.environ.get("SING_CONFIG") or SYSTEM_CONFIG)
    try:
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError):
        return None
    section = data.get("singularityd", data)
    value = section.get("socket") if isinstance(section, dict) else None
    return Path(value) if isinstance(value, str) else None


def resolve_socket(flag: str | None) -> Path:
    """The socket to use: --socket, then SING_SOCKET, then the user's sing.toml, then the daemon's
    config file, then the defaults.

    The default is the system daemon's socket; a non-root user without one falls back to their
    own user-mode daemon's socket when it exists.
    """
    if flag:
        return Path(flag)
    if os.environ.get("SING_SOCKET"):
        return Path(os.environ["SING_SOCKET"])
    if settings().socket:
        return Path(str(settings().socket)).expanduser()
    configured = _config_socket()
    if configured is not None:
        return configured
    if os.geteuid() != 0 and not SYSTEM_SOCKET.exists() and _owned_privately(_user_socket().parent):
        return _user_socket()
    return SYSTEM_SOCKET


def _owned_privately(folder: Path) -> bool:
    """Whether a folder is the caller's own, mode 0700, and not a link (so no one else planted it)."""
    try:
        info = folder.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700


def unreachable_message(socket_path: Path) -> str:
    """Why the daemon cannot be reached at this socket, and how to fix it."""
    if not socket_path.exists():
        why = "no such socket"
    elif not os.access(socket_path, os.R_OK | os.W_OK):
        return f"cannot reach singularityd at {socket_path}: permission denied on the socket"
    else:
        why = "nothing is listening"
    return f"cannot reach singularityd at {socket_path} ({why}); {START_HINT}"


class Connection:
    """A gRPC channel to the daemon plus its stub."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        options = [("grpc.enable_retries", 0), ("grpc.max_receive_message_length", MAX_REPLY_BYTES)]
        self.channel = grpc.insecure_channel(f"unix:{socket_path}", options=options)
        self.stub = pb_grpc.SingularityStub(self.channel)

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()


LOST_CONNECTION = ("Socket closed", "Connection reset", "GOAWAY", "Broken pipe")
"""What gRPC says when a connection it had ends during a call (a refused one says otherwise)."""


def rpc_error(error: grpc.RpcError, socket_path: Path) -> CliError:
    """A CliError for a failed call, with the daemon's message and the matching exit code."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    if code == grpc.StatusCode.UNAVAILABLE:
        if any(sign in (details or "") for sign in LOST_CONNECTION):
            return CliError(
                f"the connection to singularityd at {socket_path} was lost during the request (the "
                "daemon stopped?); it may have been carried out: see `sing ps -a` or `sing show ID`",
                EXIT_UNAVAILABLE,
            )
        return CliError(unreachable_message(socket_path), EXIT_UNAVAILABLE)
    return CliError(details or str(code), exit_code_for_status(code))


@contextmanager
def connect(socket_flag: str | None) -> Iterator[Any]:
    """Yield the daemon's stub; failures of calls made inside become CliErrors."""
    socket_path = resolve_socket(socket_flag)
    if not socket_path.exists():
        raise CliError(unreachable_message(socket_path), EXIT_UNAVAILABLE)
    connection = Connection(socket_path)
    try:
        yield connection.stub
    except grpc.RpcError as error:
        raise rpc_error(error, socket_path) from None
    finally:
        connection.close()
