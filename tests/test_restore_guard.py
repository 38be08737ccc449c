"""CRIU's changes to the filesystem by name, and its opens through a link, carry the job user's
rights, not root's (singularityd/checkpoint/restore_guard.c, preloaded into CRIU for another
user's restore).

The guard is tested alone, preloaded into a real process that makes the changes and opens CRIU
makes, and whole: a real daemon held just after its restore's path check, while the job's user swaps the
folder of the job's bound socket for a link to root's folder, then CRIU restoring for real.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from singularityd import faults
from singularityd.checkpoint import CriuInfo
from singularityd.checkpoint.restore_guard import build_restore_guard, guard_environment, load_problem
from tests.checkpoint_helpers import SYSTEM_PYTHON
from tests.conftest import requires_root
from tests.helpers import other_user, running_daemon, wait_until
from tests.test_reopened import (
    LISTENER,
    python_of,
    resumes_once_put_back,
    users_socket_folder_and_roots_socket,
)


@pytest.fixture(scope="module")
def library() -> Iterator[str]:
    """The guard, built as a root daemon builds it."""
    with tempfile.TemporaryDirectory() as folder:
        built, problem = build_restore_guard(Path(folder) / "guard")
        if problem:
            pytest.skip(f"the restore guard cannot be built here: {problem}")
        yield built


@pytest.fixture
def ground() -> Iterator[Path]:
    """A root folder others may enter (like /etc), under /tmp."""
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:
        os.chmod(folder, 0o755)
        yield Path(folder)


def test_the_guard_is_built_once_into_a_root_only_folder(tmp_path: Path) -> None:
    folder = tmp_path / "guard"
    first, problem = build_restore_guard(folder)
    if problem:
        pytest.skip(f"the restore guard cannot be built here: {problem}")
    built_at = os.stat(first).st_mtime_ns
    assert build_restore_guard(folder) == (first, "") and os.stat(first).st_mtime_ns == built_at
    assert folder.stat().st_mode & 0o777 == 0o700 and os.listdir(folder) == [Path(first).name]


def test_the_guard_is_found_active_in_criu_and_nowhere_else(library: str, criu_info: CriuInfo) -> None:
    """It acts only in a program named criu (not in a wrapper script CRIU is run through)."""
    assert load_problem(library, criu_info.argv) == ""
    assert load_problem(library, ["/bin/true"]).startswith("it is not active in /bin/true")


def test_without_a_compiler_the_reason_is_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert build_restore_guard(tmp_path / "guard") == ("", "no C compiler (cc) is installed to build it")


def guarded(library: str, code: str, *, places: tuple[Path, ...] = (), user: str = "") -> dict[str, str]:
    """Run `code` as root with the guard preloaded for `user` (another user by default): what each
    of its steps, printed as `step: outcome`, gave."""
    owner = pwd.getpwnam(user or other_user())
    groups = os.getgrouplist(owner.pw_name, owner.pw_gid)
    env = {
        **os.environ,
        "LD_PRELOAD": library,
        **guard_environment(owner.pw_uid, owner.pw_gid, groups, places),
    }
    prelude = (
        "import os, socket, sys\n"
        "def step(name, change):\n"
        "    try:\n"
        "        change(); print(f'{name}: ok')\n"
        "    except OSError as error:\n"
        "        print(f'{name}: {error.strerror}')\n"
        "def create(path):\n"
        "    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))\n"
        "def opened(path, flags=os.O_RDONLY):\n"
        "    os.close(os.open(path, flags))\n"
    )
    run = subprocess.run(
        ["criu-like", "-S", "-c", prelude + code],
        executable=SYSTEM_PYTHON,  # named criu*, as the guard acts only in CRIU
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    return dict(line.split(": ", 1) for line in run.stdout.splitlines())


def users_folder(ground: Path, name: str) -> Path:
    """A folder of the other user's inside `ground`."""
    owner = pwd.getpwnam(other_user())
    folder = ground / name
    folder.mkdir()
    os.chown(folder, owner.pw_uid, owner.pw_gid)
    return folder


@requires_root
def test_changes_in_roots_folders_are_refused_and_in_the_users_own_made_as_the_user(
    library: str, ground: Path
) -> None:
    victim = ground / "victim"
    victim.write_text("root's")
    victim.chmod(0o600)
    os.mkfifo(ground / "fifo", 0o600)
    own = users_folder(ground, "own")
    (own / "link").symlink_to(ground)
    (ground / "mine").write_text("the user's")
    os.chown(ground / "mine", pwd.getpwnam(other_user()).pw_uid, -1)
    outcome = guarded(
        library,
        f"""
step("create in root's folder", lambda: create({str(ground / "new")!r}))
step("make a folder in root's folder", lambda: os.mkdir({str(ground / "dir")!r}))
step("give root's file away", lambda: os.chown({str(victim)!r}, {pwd.getpwnam(other_user()).pw_uid}, -1))
step("open root's file mode", lambda: os.chmod({str(victim)!r}, 0o666))
step("remove root's file", lambda: os.unlink({str(victim)!r}))
step("bind in root's folder", lambda: socket.socket(socket.AF_UNIX).bind({str(ground / "sock")!r}))
step("create in own folder", lambda: create({str(own / "file")!r}))
step("bind in own folder", lambda: socket.socket(socket.AF_UNIX).bind({str(own / "sock")!r}))
step("read root's file", lambda: opened({str(victim)!r}))
step("read root's file through a link", lambda: opened({str(own / "link" / "victim")!r}))
step("open root's FIFO through a link", lambda: opened({str(own / "link" / "fifo")!r}, os.O_RDWR))
step("read own file through a link", lambda: opened({str(own / "link" / "mine")!r}))
step("read a file of /proc", lambda: opened("/proc/self/status"))
""",
    )
    assert outcome == {
        "create in root's folder": "Permission denied",
        "make a folder in root's folder": "Permission denied",
        "give root's file away": "Operation not permitted",
        "open root's file mode": "Operation not permitted",
        "remove root's file": "Permission denied",
        "bind in root's folder": "Permission denied",
        "create in own folder": "ok",
        "bind in own folder": "ok",
        "read root's file": "ok",  # by a path without links: checkpoint.reopened checks it after
        "read root's file through a link": "Permission denied",
        "open root's FIFO through a link": "Permission denied",
        "read own file through a link": "ok",
        "read a file of /proc": "ok",
    }
    owner = pwd.getpwnam(other_user())
    assert (
        victim.read_text() == "root's"
        and victim.stat().st_uid == 0
        and victim.stat().st_mode & 0o777 == 0o600
    )
    assert not (ground / "new").exists() and not (ground / "dir").exists() and not (ground / "sock").exists()
    assert (own / "file").stat().st_uid == owner.pw_uid and (own / "sock").stat().st_uid == owner.pw_uid


@requires_root
def test_a_link_or_a_working_folder_reached_through_one_gains_the_user_nothing(
    library: str, ground: Path
) -> None:
    """A folder of the user's swapped for a link to root's folder, by absolute path and as the working
    folder CRIU changed into by that path (sk-unix binds relative to it)."""
    own = users_folder(ground, "own")
    (own / "run").symlink_to(ground)
    outcome = guarded(
        library,
        f"""
step("bind through the link", lambda: socket.socket(socket.AF_UNIX).bind({str(own / "run" / "sock")!r}))
os.chdir({str(own / "run")!r})
step("bind in the folder changed into", lambda: socket.socket(socket.AF_UNIX).bind("sock"))
step("create in the folder changed into", lambda: create("new"))
""",
    )
    assert set(outcome.values()) == {"Permission denied"}, outcome
    assert sorted(os.listdir(ground)) == ["own"]


@requires_root
def test_criu_keeps_roots_rights_in_its_own_folders(library: str, ground: Path) -> None:
    """The places named (images, logs) and the temporary folders CRIU makes in /tmp stay root's work."""
    images = ground / "images"
    images.mkdir(mode=0o700)
    with tempfile.TemporaryDirectory(prefix=".criu.mntns.", dir="/tmp") as temporary:
        outcome = guarded(
            library,
            f"""
step("write in images", lambda: create({str(images / "stats-restore")!r}))
step("make a mount point in CRIU's folder", lambda: os.mkdir({str(Path(temporary) / "12")!r}))
step("open CRIU's folder to all", lambda: os.chmod({temporary!r}, 0o777))
""",
            places=(images,),
        )
        assert set(outcome.values()) == {"ok"}, outcome
        assert (Path(temporary) / "12").stat().st_uid == 0
    assert (images / "stats-restore").stat().st_uid == 0


@requires_root
def test_a_folder_named_like_crius_but_the_users_is_not_criu_ground(library: str, ground: Path) -> None:
    mimic = users_folder(ground, ".criu.mntns.mine")
    outcome = guarded(library, f'step("mkdir", lambda: os.mkdir({str(mimic / "x")!r}))\n')
    assert outcome == {"mkdir": "ok"}
    assert (mimic / "x").stat().st_uid == pwd.getpwnam(other_user()).pw_uid


@requires_root
def test_root_jobs_are_not_guarded(library: str, ground: Path) -> None:
    outcome = guarded(library, f'step("mkdir", lambda: os.mkdir({str(ground / "dir")!r}))\n', user="root")
    assert outcome == {"mkdir": "ok"}


@requires_root
@pytest.mark.slow
def test_a_folder_swapped_after_the_restores_check_gains_the_user_nothing(
    daemon_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job's user swaps its socket's folder for a link to root's folder holding root's socket
    after the daemon checked the paths and before CRIU runs: CRIU, which unlinks what is at a bound
    socket's path and binds there, may do so only as the user: root's socket stays, the restore
    fails with the checkpoint kept, and with the folder put back the job resumes."""
    owner = pwd.getpwnam(other_user())
    python = python_of(owner.pw_name)
    home, room, roots, script = users_socket_folder_and_roots_socket(daemon_root, owner)
    roots_inode = (room / "sock").stat().st_ino
    release, hold = daemon_root / "release", daemon_root / "hold-restore-checked"
    monkeypatch.setenv(faults.ENV, faults.RESTORE_CHECKED)
    monkeypatch.setenv(faults.HOLD_ENV, str(hold))
    try:
        with running_daemon(daemon_root, virtual_devices=1) as daemon:
            job = daemon.submit(
                *python, str(script), str(home / "run" / "sock"), str(release), user=owner.pw_name
            )
            wait_until(lambda: "bound" in daemon.sing("logs", str(job)).out, timeout=60)
            assert daemon.sing("suspend", str(job), user=owner.pw_name).code == 0
            with ThreadPoolExecutor(1) as pool:
                resuming = pool.submit(
                    daemon.sing, "resume", "--wait", str(job), user=owner.pw_name, timeout=120
                )
                wait_until(Path(f"{hold}.reached").exists, timeout=60)
                (home / "run").rename(home / "put-aside")
                (home / "run").symlink_to(room)
                os.lchown(home / "run", owner.pw_uid, owner.pw_gid)
                hold.touch()
                refused = resuming.result(timeout=130)
            assert refused.code != 0 and "holds something its user may not remove" in refused.err, refused.err
            assert (room / "sock").is_socket() and (room / "sock").stat().st_ino == roots_inode
            assert all(entry.stat(follow_symlinks=False).st_uid == 0 for entry in room.iterdir())
            assert daemon.job(job)["state"] == "SUSPENDED"
            resumes_once_put_back(daemon, job, owner.pw_name, home / "run", home / "put-aside", release)
    finally:
        roots.close()


@requires_root
@pytest.mark.slow
def test_a_socket_bound_through_its_users_own_link_is_restored(daemon_root: Path) -> None:
    """A job may bind through a link of its user's (CRIU binds by that name again): under the guard
    that is its user's own business, so the job resumes (the check for links on the way, which
    only a restore as root needs, refused it at every restore)."""
    owner = pwd.getpwnam(other_user())
    python = python_of(owner.pw_name)
    home = daemon_root / "home"
    (home / "real").mkdir(parents=True)
    (home / "run").symlink_to(home / "real")
    for path in (home, home / "real", home / "run"):
        os.lchown(path, owner.pw_uid, owner.pw_gid)
    script = home / "listener.py"
    script.write_text(LISTENER)
    release = daemon_root / "release"
    with running_daemon(daemon_root, virtual_devices=1) as daemon:
        job = daemon.submit(
            *python, str(script), str(home / "run" / "sock"), str(release), user=owner.pw_name
        )
        wait_until(lambda: "bound" in daemon.sing("logs", str(job)).out, timeout=60)
        assert daemon.sing("suspend", str(job), user=owner.pw_name).code == 0
        resumed = daemon.sing("resume", "--wait", str(job), user=owner.pw_name, timeout=120)
        assert resumed.code == 0, resumed.err
        assert (home / "real" / "sock").is_socket() and (home / "real" / "sock").stat().st_uid == owner.pw_uid
        release.touch()
        daemon.wait_ok(job, timeout=120)
