"""The fault tests' referee counts only copies that can run the job's code as live (referee.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from singularityd.checkpoint import CriuInfo
from singularityd.checkpoint.criu import Criu
from singularityd.checkpoint.precheck import signal_tree
from singularityd.checkpoint.service import Checkpointer
from singularityd.checkpoint.store import ImageStore
from tests.checkpoint_helpers import start_job, wait_for_line
from tests.federation.referee import copies_by_pid
from tests.helpers import wait_until

SLEEPER = "import sys, time\nwhile True:\n    print('tick', flush=True)\n    time.sleep(0.05)\n"
ROOT = os.geteuid() == 0


def sleeper(marker: str, *parent_args: str) -> tuple[subprocess.Popen[bytes], int]:
    """A process with `marker` in its command line, started by a parent whose arguments end in
    `parent_args`; returns the parent and the marked process's pid."""
    child = [sys.executable, "-c", SLEEPER, marker]
    spawn = "import json, os, subprocess; subprocess.run(json.loads(os.environ['CHILD']))"
    parent = subprocess.Popen(
        [sys.executable, "-c", spawn, *parent_args],
        stdout=subprocess.DEVNULL,
        env={**os.environ, "CHILD": json.dumps(child)},
    )
    pid = wait_until(lambda: next(iter(copies_by_pid(marker)), None), timeout=30, interval=0.02)
    return parent, pid


def test_a_stopped_process_is_not_a_live_copy(tmp_path: Path) -> None:
    marker = str(tmp_path / "marker-stopped")
    parent, pid = sleeper(marker)
    try:
        assert copies_by_pid(marker) == {pid: True}
        os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: copies_by_pid(marker) == {pid: False}, timeout=30, interval=0.02)
        os.kill(pid, signal.SIGCONT)
        wait_until(lambda: copies_by_pid(marker) == {pid: True}, timeout=30, interval=0.02)
    finally:
        os.kill(pid, signal.SIGKILL)
        parent.wait(30)
    assert copies_by_pid(marker) == {}


def liveness_under(tmp_path: Path, *parent_args: str) -> bool:
    """Whether a process whose parent has `parent_args` is a live copy (both ended afterwards)."""
    marker = str(tmp_path / f"marker-{len(parent_args)}-{'_'.join(parent_args)}-end")
    parent, pid = sleeper(marker, *parent_args)
    try:
        return copies_by_pid(marker)[pid]
    finally:
        parent.kill()
        os.kill(pid, signal.SIGKILL)
        parent.wait(30)
        wait_until(lambda: not copies_by_pid(marker), timeout=30, interval=0.02)


def test_a_process_under_a_restore_that_leaves_it_stopped_is_not_live(tmp_path: Path) -> None:
    """While `criu restore --leave-stopped` runs, its tasks run CRIU's restorer code under the job's
    command line: not live. (The parent here stands in for CRIU by its arguments alone.)"""
    assert not liveness_under(tmp_path, "restore", "--leave-stopped")
    assert liveness_under(tmp_path, "restore")
    assert liveness_under(tmp_path)


@pytest.mark.root
@pytest.mark.skipif(not ROOT, reason="needs root (CRIU)")
def test_a_copy_criu_restored_stopped_is_live_only_once_continued(
    criu_info: CriuInfo, work: Path, jobs: list[int]
) -> None:
    """A job dumped by CRIU and restored with --leave-stopped (as a move's target does): every
    process of the copy is dormant until SIGCONT, then live."""
    marker = str(work / "marker-criu")
    script = work / "sleeper.py"
    script.write_text(SLEEPER)
    script.chmod(0o644)
    job = asyncio.run(start_job(work / "job", ["/usr/bin/python3", str(script), marker], cwd=work))
    jobs.append(job.pid)
    assert wait_for_line(job.log(), "tick\n", 30)
    criu = Criu(criu_info)
    stopped = Criu(criu_info, replace(criu.options, extra_restore_args=("--leave-stopped",)))
    store = ImageStore(work / "store")
    dumped = asyncio.run(
        Checkpointer(criu, store).checkpoint("job", job.pid, owner_uid=0, owner_gid=0, leave_running=False)
    )
    wait_until(lambda: copies_by_pid(marker) == {}, timeout=30, interval=0.05)
    restored = asyncio.run(Checkpointer(stopped, store).restore("job", dumped.seq, rewind=False))
    jobs.append(restored.pid)
    copies = copies_by_pid(marker)
    assert copies and not any(copies.values()), copies
    signal_tree(restored.pid, signal.SIGCONT)
    wait_until(lambda: all(copies_by_pid(marker, list(copies)).values()), timeout=30, interval=0.05)
