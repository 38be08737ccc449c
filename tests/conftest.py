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

from singularityd.checkpoint import CheckpointUnavailable, CriuInfo, locate_criu
from singularityd.jobs.processes import process_start_ticks
from tests.checkpoint_helpers import kill_tree
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
    _kill_holders_of(state_dir.parent)


def _kill_holders_of(root: Path) -> None:
    """Kill any process left with a file open under the test's folder (a server whose record was
    never written, a job's orphan): nothing a test started may outlive it."""
    prefix = str(root) + os.sep
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(fd).startswith(prefix) for fd in (entry / "fd").iterdir()):
                os.kill(int(entry.name), signal.SIGKILL)


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


@pytest.fixture(scope="module")
def criu_info() -> CriuInfo:
    """The CRIU the checkpoint tests use (SINGULARITYD_TEST_CRIU, else found as the daemon would)."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    try:
        return locate_criu(os.environ.get("SINGULARITYD_TEST_CRIU", "auto"))
    except CheckpointUnavailable as e:
        pytest.skip(f"no usable CRIU: {e}")


@pytest.fixture
def work() -> Iterator[Path]:
    """A scratch folder (in /dev/shm when there is one) that other test users can reach."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = Path(tempfile.mkdtemp(prefix="sing-ckpt-", dir=base))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def jobs() -> Iterator[list[int]]:
    """Host PIDs of the job trees a test started; each is killed with its tree afterwards."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        kill_tree(pid)
