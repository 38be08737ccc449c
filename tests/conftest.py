"""Shared fixtures: a fresh real daemon per test, and cleanup of the jobs it leaves behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from singularityd.jobs.processes import process_start_ticks
from tests.helpers import Daemon, running_daemon

requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (users, PID namespaces)")


def _kill_jobs_under(state_dir: Path) -> None:
    """Kill the job supervisors and proxy servers a test left running (they outlive daemons).

    A recorded PID is killed only if it still names the same process (by its start time).
    """
    recorded: list[tuple[int, int]] = []
    for pid_file in state_dir.glob("jobs/*/init.pid"):
        with contextlib.suppress(ValueError, OSError):
            pid, ticks = (int(field) for field in pid_file.read_text().split()[:2])
            recorded.append((pid, ticks))
    for record in state_dir.glob("proxy/servers/job-*-dev-*.json"):
        with contextlib.suppress(ValueError, OSError, KeyError, TypeError):
            facts = json.loads(record.read_text())
            recorded.append((int(facts["pid"]), int(facts["ticks"])))
    for pid, ticks in recorded:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and process_start_ticks(pid) == ticks:
                os.kill(pid, signal.SIGKILL)
        except (psutil.Error, ProcessLookupError):
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
