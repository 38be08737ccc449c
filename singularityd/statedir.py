"""The daemon's folders, and the lock that keeps a second daemon off the same state."""

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


def prepare_state(config: Config) -> IO[str]:
    """Create the state, jobs and socket folders with their modes and take the daemon's lock.

    Returns the open lock file, held for the daemon's life; ConfigError when another daemon
    already uses this state directory or listens on the socket.
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
    lock = open(config.state_dir / "daemon.lock", "w")  # noqa: SIM115
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise ConfigError(
            f"another singularityd is already running with state directory {config.state_dir}"
        ) from None
    if socket_answers(config.socket):
        lock.close()
        raise ConfigError(f"another singularityd is already listening on {config.socket}")
    return lock
