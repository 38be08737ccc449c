"""The daemon's folders, and the locks that keep a second daemon off the same state and off the
same socket folder (whose private sockets and proxy folders are per folder, not per socket)."""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import IO

from singularityd.config import Config, ConfigError


def socket_answers(path: Path) -> bool:
    """Whether something accepts connections on this Unix socket."""
    if not path.exists():
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _locked(path: Path, refusal: str) -> IO[str]:
    """The open file at `path`, locked for this process's life; ConfigError(refusal) when another
    process holds its lock."""
    lock = open(path, "w")  # noqa: SIM115
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise ConfigError(refusal) from None
    return lock


def prepare_state(config: Config) -> list[IO[str]]:
    """Create the state, jobs and socket folders with their modes and take the daemon's locks.

    Returns the open lock files, held for the daemon's life; ConfigError when another daemon
    already uses this state directory or this socket folder, or listens on the socket.
    """
    config.state_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(config.state_dir, 0o755 if not config.user_mode else 0o700)
    config.jobs_dir.mkdir(exist_ok=True)
    os.chmod(config.jobs_dir, 0o711 if not config.user_mode else 0o700)
    config.socket.parent.mkdir(parents=True, exist_ok=True)
    if config.user_mode:
        os.chmod(config.socket.parent, 0o700)
    config.internal_socket_dir.mkdir(exist_ok=True)
    os.chmod(config.internal_socket_dir, 0o700)
    locks = [
        _locked(
            config.state_dir / "daemon.lock",
            f"another singularityd is already running with state directory {config.state_dir}",
        )
    ]
    try:
        if socket_answers(config.socket):
            raise ConfigError(f"another singularityd is already listening on {config.socket}")
        locks.append(
            _locked(
                config.internal_socket_dir / "daemon.lock",
                f"another singularityd already has its socket in {config.socket.parent} (its "
                "private sockets and proxy folders are kept there): give each daemon a socket "
                "folder of its own",
            )
        )
    except ConfigError:
        for lock in locks:
            lock.close()
        raise
    return locks
