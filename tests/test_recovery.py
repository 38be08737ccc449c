"""Crash safety: SIGKILL the daemon while jobs run and queue, restart it, lose nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers import SING, SINGULARITYD, Daemon, running_daemon, wait_until


def gated_job(release: Path, code: int) -> tuple[str, ...]:
    """A job that prints, waits for a file to appear, prints again and exits with `code`."""
    script = f"echo before; while [ ! -e {release} ]; do sleep 0.05; done; echo after; exit {code}"
    return ("sh", "-c", script)


def test_sigkill_restart_keeps_every_job(daemon_root: Path) -> None:
    release_a, release_b = daemon_root / "release-a", daemon_root / "release-b"
    with running_daemon(daemon_root, virtual_devices=2) as daemon:
        job_a = daemon.submit(*gated_job(release_a, 0))
        job_b = daemon.submit(*gated_job(release_b, 7))
        job_c = daemon.submit("sh", "-c", "echo third")
        daemon.wait_state(job_a, "RUNNING")
        daemon.wait_state(job_b, "RUNNING")
        wait_until(lambda: daemon.sing("logs", str(job_b)).out == "before\n")
        assert daemon.job(job_c)["state"] == "PENDING"
        assert daemon.stop(signal.SIGKILL) == -signal.SIGKILL

        release_a.touch()  # job A ends while no daemon is watching
        restarted = Daemon(daemon_root, virtual_devices=2)
        restarted.start()
        try:
            a = restarted.wait_state(job_a, "COMPLETED")
            assert a["exit_code"] == 0
            assert restarted.sing("logs", str(job_a)).out == "before\nafter\n"
            # B was re-adopted: still running on its device, still logging.
            b = restarted.job(job_b)
            assert b["state"] == "RUNNING" and b["devices"] in ([0], [1])
            c = restarted.wait_state(job_c, "RUNNING", "COMPLETED")
            assert c["state"] in ("RUNNING", "COMPLETED")
            release_b.touch()
            b = restarted.wait_state(job_b, "FAILED")
            assert b["exit_code"] == 7 and b["reason"] == "exited with code 7"
            assert restarted.sing("logs", str(job_b)).out == "before\nafter\n"
            assert restarted.sing("wait", str(job_c)).code == 0
            assert restarted.sing("logs", str(job_c)).out == "third\n"
            assert restarted.sing("wait", str(job_b)).code == 7
        finally:
            restarted.stop()


def test_sigterm_is_graceful_and_jobs_survive(daemon_root: Path) -> None:
    release = daemon_root / "release"
    with running_daemon(daemon_root) as daemon:
        job = daemon.submit(*gated_job(release, 0))
        daemon.wait_state(job, "RUNNING")
        assert daemon.stop(signal.SIGTERM) == 0
        assert not daemon.socket.exists()
        assert "stopping (running jobs keep running" in daemon.log.read_text()
        daemon.start()
        assert daemon.job(job)["state"] == "RUNNING"
        release.touch()
        assert daemon.sing("wait", str(job)).code == 0


def test_job_killed_while_daemon_down_is_recorded(daemon_root: Path) -> None:
    with running_daemon(daemon_root) as daemon:
        job = daemon.submit("sleep", "300")
        daemon.wait_state(job, "RUNNING")
        pid = daemon.supervisor_pid(job)
        daemon.stop(signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)
        wait_until(
            lambda: (
                not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
            )
        )
        daemon.start()
        lost = daemon.wait_state(job, "FAILED")
        assert "while the daemon was down" in lost["reason"]


def test_second_daemon_on_same_state_is_refused(daemon: Daemon) -> None:
    result = subprocess.run(
        [SINGULARITYD, "--socket", str(daemon.root / "other.sock"), "--state-dir", str(daemon.state_dir)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 2
    assert "another singularityd is already running" in result.stderr


def test_second_daemon_with_its_socket_in_the_same_folder_is_refused(daemon: Daemon, tmp_path: Path) -> None:
    """Daemons whose sockets share a folder would share its private per-user sockets and proxy
    folders (the last started took the first's connections, and removed them when it stopped):
    the second is refused, and the first goes on answering."""
    first = daemon.submit("true")
    neighbour = daemon.socket.parent / "other.sock"
    result = subprocess.run(
        [SINGULARITYD, "--socket", str(neighbour), "--state-dir", str(tmp_path / "s")],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "already has its socket in" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert [job["id"] for job in daemon.sing("ps", "-a", "-o", "json").json()] == [first]


def test_a_request_cut_off_by_the_daemons_death_says_so(daemon_root: Path) -> None:
    """`sing checkpoint` waiting on a checkpoint when the daemon is killed said "nothing is
    listening", as if it had never been reached; what it asked may have been done."""
    with running_daemon(daemon_root, config={"device_proxy": False, "checkpoint_pre_copy": 0}) as daemon:
        script = "import time\nx = bytearray(400 * 2**20)\nwhile True: time.sleep(0.1)"
        job = daemon.submit(sys.executable, "-c", script)
        daemon.wait_state(job, "RUNNING")
        env = {**os.environ, "SING_SOCKET": str(daemon.socket)}
        asking = subprocess.Popen(
            [SING, "checkpoint", str(job)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        wait_until(lambda: "checkpoint requested" in str(daemon.job(job)["events"]))
        daemon.stop(signal.SIGKILL)
        _, err = asking.communicate(timeout=60)
        assert asking.returncode == 3, err
        assert "was lost during the request" in err and "Traceback" not in err
