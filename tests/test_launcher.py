"""The job's launcher and supervisor (singularityd/jobs/launcher.py): the final status on a full
disk, and the /proc a job in its own PID namespace sees."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from singularityd.jobs import launcher
from singularityd.jobs.paths import JobPaths
from singularityd.jobs.processes import missing_status_reason, read_exit_status
from tests.checkpoint_helpers import small_tmpfs
from tests.conftest import requires_root
from tests.helpers import running_daemon, wait_until


def fill(folder: Path) -> None:
    """Fill the file system of `folder` to the last byte."""
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={folder / 'filler'}", "bs=64k"], capture_output=True, check=False
    )


@requires_root
def test_a_job_ending_on_a_full_disk_keeps_its_exit_status(tmp_path: Path) -> None:
    """A supervisor that could not write its status file lost the job's exit code: the job failed
    with "the job's supervisor was killed before it recorded an exit status"."""
    with small_tmpfs(tmp_path / "small", "1m") as folder:
        paths = JobPaths(folder)
        launcher.reserve_status(str(paths.status))
        fill(folder)
        ranks = [{"rank": r, "exit_code": 7, "signal": None} for r in range(64)]
        launcher._write_status(
            str(paths.status), {"exit_code": 7, "signal": None, "error": "", "ranks": ranks}
        )
        status = read_exit_status(paths)
        assert status is not None and (status.exit_code, status.signal) == (7, None)
        assert not list(folder.glob("status.json.*"))


@requires_root
def test_a_status_lost_to_a_full_disk_is_not_blamed_on_a_kill(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "small", "1m") as folder:
        paths = JobPaths(folder)
        assert (
            missing_status_reason(paths)
            == "the job's supervisor was killed before it recorded an exit status"
        )
        fill(folder)
        assert missing_status_reason(paths) == (
            f"the job's supervisor could not record its exit status: the disk holding {folder} is full"
        )


SEES_ITSELF = """
import os, sys, time
def seen():
    with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
        return "itself" if sys.argv[0].encode() in f.read() else "another process"
print("before:", os.getpid(), seen(), flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
print("after:", os.getpid(), seen(), flush=True)
"""


@requires_root
def test_a_job_finds_itself_in_proc_by_its_own_pid_before_and_after_a_preemption(daemon_root: Path) -> None:
    """A root job runs in a PID namespace of its own: /proc/<os.getpid()> (what psutil.Process()
    reads) must be that job's process, not the host's process of that number."""
    script, release = daemon_root / "sees_itself.py", daemon_root / "release"
    script.write_text(SEES_ITSELF)
    with running_daemon(daemon_root, virtual_devices=1) as daemon:
        job = daemon.submit(sys.executable, str(script), str(release))
        wait_until(lambda: "before:" in daemon.sing("logs", str(job)).out, timeout=60)
        assert daemon.sing("preempt", str(job), timeout=120).code == 0
        daemon.wait_state(job, "RUNNING")
        release.touch()
        daemon.wait_ok(job, timeout=120)
        lines = daemon.sing("logs", str(job)).out.splitlines()
    pid = lines[0].split()[1]
    assert lines == [f"before: {pid} itself", f"after: {pid} itself"], lines
