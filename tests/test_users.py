"""Identity and permissions: jobs run as the kernel-proven submitter; users act on their own jobs."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import requires_root
from tests.helpers import Daemon, ensure_user, python_for_user, running_daemon, wait_until

pytestmark = requires_root
ADMINS = "sing-test-admins"
PREMIUM_USERS = "sing-test-premium"


@pytest.fixture
def users() -> dict[str, pwd.struct_passwd]:
    return {
        "alice": ensure_user("sing-alice"),
        "bob": ensure_user("sing-bob"),
        "carol": ensure_user("sing-carol", groups=[ADMINS]),
    }


@pytest.fixture
def lab_daemon(daemon_root: Path) -> Iterator[Daemon]:
    with running_daemon(daemon_root, config={"admin_group": ADMINS}) as daemon:
        yield daemon


def test_job_runs_as_the_submitter(lab_daemon: Daemon, users: dict[str, pwd.struct_passwd]) -> None:
    alice = users["alice"]
    release = lab_daemon.root / "release"
    job = lab_daemon.submit(
        "sh", "-c", f"id -u; id -g; echo $USER; while [ ! -e {release} ]; do sleep 0.05; done",
        options=["--env", "USER=root"], user="sing-alice",
    )  # fmt: skip
    lab_daemon.wait_state(job, "RUNNING")
    supervisor = psutil.Process(lab_daemon.supervisor_pid(job))
    rank = wait_until(lambda: supervisor.children())[0]
    uid_line = next(
        line for line in Path(f"/proc/{rank.pid}/status").read_text().splitlines() if line.startswith("Uid:")
    )
    assert uid_line.split()[1:] == [str(alice.pw_uid)] * 4, "the kernel must see the rank as alice"
    assert supervisor.uids().real == 0, "the supervisor (the job's PID 1, never the user's code) stays root"
    release.touch()
    assert lab_daemon.sing("wait", str(job), user="sing-alice").code == 0
    out = lab_daemon.sing("logs", str(job), user="sing-alice").out.split()
    assert out == [str(alice.pw_uid), str(alice.pw_gid), "sing-alice"]
    info = lab_daemon.job(job)
    assert info["user"] == "sing-alice" and info["uid"] == alice.pw_uid

    log = lab_daemon.state_dir / "jobs" / str(job) / "logs" / "rank-0.log"
    assert log.stat().st_uid == alice.pw_uid
    assert stat.S_IMODE(log.stat().st_mode) == 0o600, "only alice (and root) read her output"
    for folder in (log.parent, log.parent.parent):
        assert folder.stat().st_uid == 0 and stat.S_IMODE(folder.stat().st_mode) == 0o711, (
            "root's folder: alice cannot swap the files root writes there for links"
        )


def test_users_act_only_on_their_own_jobs(lab_daemon: Daemon, users: dict[str, pwd.struct_passwd]) -> None:
    job = lab_daemon.submit("sleep", "300", user="sing-alice")
    lab_daemon.wait_state(job, "RUNNING")

    denied = lab_daemon.sing("cancel", str(job), user="sing-bob")
    assert denied.code == 5
    assert denied.err.strip() == f"sing: job {job} belongs to sing-alice; sing-bob may not act on it"
    assert lab_daemon.sing("logs", str(job), user="sing-bob").code == 5
    shown = lab_daemon.sing("show", str(job), "-o", "json", user="sing-bob")
    assert shown.code == 0 and shown.json()["env"] is None, "others see the job but not its environment"
    assert lab_daemon.job(job)["state"] == "RUNNING"

    assert lab_daemon.sing("cancel", str(job), user="sing-carol").code == 0, "admins may act on any job"
    lab_daemon.wait_state(job, "CANCELLED")
    events = lab_daemon.job(job)["events"]
    assert events[-1]["to_state"] == "CANCELLED"

    own = lab_daemon.submit("sleep", "300", user="sing-bob")
    assert lab_daemon.sing("cancel", str(own), user="sing-bob").code == 0


def test_a_setuid_program_in_a_job_gains_nothing(
    lab_daemon: Daemon, users: dict[str, pwd.struct_passwd]
) -> None:
    """A job's ranks run with no_new_privs: a setuid-root program they run stays their user (it
    would be root, and its memory would go into the user's checkpoint images)."""
    escalate = lab_daemon.root / "id-as-root"
    shutil.copy2("/usr/bin/id", escalate)
    os.chown(escalate, 0, 0)
    os.chmod(escalate, 0o4755)
    job = lab_daemon.submit(
        "sh", "-c", f"{escalate} -u; grep NoNewPrivs /proc/self/status", user="sing-alice"
    )
    assert lab_daemon.sing("wait", str(job), user="sing-alice").code == 0
    out = lab_daemon.sing("logs", str(job), user="sing-alice").out.split()
    assert out == [str(users["alice"].pw_uid), "NoNewPrivs:", "1"], out


def test_user_mode_daemon(users: dict[str, pwd.struct_passwd], daemon_root: Path) -> None:
    """A researcher runs the daemon as themselves: XDG paths, jobs as them, no checkpoints."""
    alice = users["alice"]
    python = python_for_user("sing-alice")
    if python is None:
        pytest.skip("no Python with this project importable by another user here")
    home = daemon_root / "alice-home"
    runtime = daemon_root / "alice-run"
    for folder in (home, runtime):
        folder.mkdir()
        os.chown(folder, alice.pw_uid, alice.pw_gid)
    env = {
        "PATH": os.environ["PATH"], "HOME": str(home), "XDG_RUNTIME_DIR": str(runtime),
        "NOTIFY_SOCKET": "",
    }  # fmt: skip
    daemon = subprocess.Popen(
        [*python, "-m", "singularityd", "--devices", "virtual"],
        user=alice.pw_uid, group=alice.pw_gid, env=env, cwd="/tmp",
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    socket_path = runtime / "singularity" / "sing.sock"
    try:
        wait_until(socket_path.exists)
        sing = [*python, "-m", "singularity.cli.main"]

        def as_alice(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [*sing, *args], capture_output=True, text=True, timeout=60,
                user=alice.pw_uid, group=alice.pw_gid, env=env, cwd="/tmp",
            )  # fmt: skip

        submitted = as_alice("submit", "--wait", "--", "id", "-u")
        assert submitted.returncode == 0, submitted.stderr
        assert as_alice("logs", submitted.stdout.strip()).stdout.strip() == str(alice.pw_uid)
        assert (home / ".local" / "state" / "singularity" / "singularity.db").exists()
        doctor = as_alice("doctor")
        assert "user mode" in doctor.stdout
        assert "checkpoints unavailable: the daemon runs as uid" in doctor.stdout
        assert "(user mode): CRIU needs root" in doctor.stdout
        assert stat.S_IMODE(socket_path.stat().st_mode) == 0o600
    finally:
        daemon.terminate()
        daemon.wait(20)


def test_premium_may_be_kept_for_a_group(daemon_root: Path, users: dict[str, pwd.struct_passwd]) -> None:
    """With premium_group set, its members, root and admins submit premium jobs; anyone else is
    refused with the reason and nothing is queued, and may still submit standard or basic jobs."""
    ensure_user("sing-dave", groups=[PREMIUM_USERS])
    config = {"admin_group": ADMINS, "premium_group": PREMIUM_USERS}
    with running_daemon(daemon_root, config=config) as daemon:
        refused = daemon.sing("submit", "--tier", "premium", "--", "true", user="sing-alice")
        assert refused.code == 5 and refused.out == ""
        assert refused.err.strip() == (
            f"sing: the premium tier is for members of {PREMIUM_USERS}; sing-alice may submit "
            "standard (the default) or basic jobs"
        )
        assert daemon.sing("ps", "-a", "-o", "json").json() == []
        jobs = {
            user: daemon.submit("true", options=["--tier", "premium"], user=user)
            for user in ("sing-dave", "sing-carol", None)
        }
        jobs["sing-alice"] = daemon.submit("true", options=["--tier", "basic"], user="sing-alice")
        for job in jobs.values():
            assert daemon.sing("wait", str(job)).code == 0
        assert {user: daemon.job(job)["tier"] for user, job in jobs.items()} == {
            "sing-dave": "premium", "sing-carol": "premium", None: "premium", "sing-alice": "basic",
        }  # fmt: skip
