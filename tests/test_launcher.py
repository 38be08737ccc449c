"""The job supervisor's records (singularityd/jobs/launcher.py): its final status on a full disk."""

from __future__ import annotations

import subprocess
from pathlib import Path

from singularityd.jobs import launcher
from singularityd.jobs.paths import JobPaths
from singularityd.jobs.processes import missing_status_reason, read_exit_status
from tests.checkpoint_helpers import small_tmpfs
from tests.conftest import requires_root


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
