"""Shared fixtures: a fresh real daemon per test, and cleanup of the jobs it leaves behind."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.helpers import Daemon, running_daemon

requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (users, PID namespaces)")


def _kill_jobs_under(state_dir: Path) -> None:
    """Kill any job supervisor a test left running (they outlive daemons by design)."""
    for pid_file in state_dir.glob("jobs/*/init.pid"):
        try:
            pid = int(pid_file.read_text().split()[0])
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE:
                os.kill(pid, signal.SIGKILL)
        except (ValueError, psutil.Error, ProcessLookupError, FileNotFoundError):
            continue


@pytest.fixture
def daemon_root() -> Iterator[Path]:
    """A folder for one daemon's socket, state and log, reachable by other test users.

    Its jobs are killed and the folder removed afterwards.
    """
    root = Path(tempfile.mkdtemp(prefix="sing-test-", dir="/tmp"))
    os.chmod(root, 0o755)
    yield root
    _kill_jobs_under(root / "state")
    if not os.environ.get("SING_KEEP_TEST_DIRS"):
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def daemon(daemon_root: Path) -> Iterator[Daemon]:
    """A running daemon with 4 virtual devices."""
    with running_daemon(daemon_root) as started:
        yield started
