"""The spool directory: job files become jobs of their owner (by fstat), bad ones get an error file.

The daemon tests drop files as real users into a real daemon's spool folder (inotify through
watchdog) and check the jobs with the real `sing`; the unit tests check the parsing and the
refusals on real files, without a daemon.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from singularityd.observe.spool import (
    DONE_DIR,
    SPOOL_MODE,
    Spool,
    SpoolRefusal,
    folder_problem,
    job_arguments,
    owner_problem,
    read_job_file,
)
from singularityd.observe.watch import FolderWatch
from tests.conftest import requires_root
from tests.helpers import Daemon, ensure_user, running_daemon, wait_until

ALICE = "sing-spool-alice"
BOB = "sing-spool-bob"
UNKNOWN_UID = 54321


# Unit tests: parsing and refusals


def me() -> pwd.struct_passwd:
    return pwd.getpwuid(os.geteuid())


def test_a_job_file_gives_the_fields_of_sing_submit() -> None:
    text = """
command = ["python", "train.py", "--epochs", "3"]
gpus = 2
ranks = 2
name = "demo"
tier = "premium"
priority = 5
cwd = "/srv/demo"
checkpoint_every = 600
max_restarts = 2
[env]
OMP_NUM_THREADS = "1"
"""
    args = job_arguments(text, me(), "file-stem")
    assert args.command == ("python", "train.py", "--epochs", "3")
    assert (args.gpus, args.ranks, args.name, args.tier, args.priority) == (2, 2, "demo", "premium", 5)
    assert (args.cwd, args.checkpoint_interval, args.max_restarts) == ("/srv/demo", 600.0, 2)
    assert args.env["OMP_NUM_THREADS"] == "1"
    assert args.env["USER"] == me().pw_name and args.env["HOME"] == me().pw_dir


def test_defaults_and_a_command_string() -> None:
    args = job_arguments("command = \"sh -c 'echo hi there'\"\n", me(), "nightly")
    assert args.command == ("sh", "-c", "echo hi there")
    assert (args.gpus, args.ranks, args.priority, args.tier, args.name) == (1, 1, 0, "", "nightly")
    assert args.cwd == me().pw_dir and args.checkpoint_interval is None and args.max_restarts == 0
    assert (args.min_gpus, args.max_gpus) == (0, 0)


def test_an_elastic_job_file_asks_for_its_maximum_by_default() -> None:
    """min_gpus/max_gpus make the job elastic; without gpus it asks for max_gpus at start."""
    args = job_arguments('command = "true"\nranks = 4\nmin_gpus = 1\nmax_gpus = 3\n', me(), "elastic")
    assert (args.gpus, args.ranks, args.min_gpus, args.max_gpus) == (3, 4, 1, 3)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("command = [", "not valid TOML"),
        ("gpus = 1\n", "command is missing"),
        ("command = []\n", "command is missing"),
        ("command = 'true'\ngpu = 2\n", "unknown field 'gpu'"),
        ("command = 'true'\ngpus = '2'\n", "gpus must be a whole number"),
        ("command = 'true'\ngpus = true\n", "gpus must be a whole number"),
        ("command = 'true'\nenv = { A = 1 }\n", "env must be a table of strings"),
        ("command = 'true'\ncheckpoint_every = 'often'\n", "checkpoint_every must be a number"),
        ("command = 'true'\nuser = 'someone-else'\n", "names someone-else, but a spooled job runs as"),
        ("command = 'true'\nuid = 4242\n", "names uid 4242, but a spooled job runs as"),
    ],
)
def test_bad_job_files_are_refused_with_one_line(text: str, message: str) -> None:
    with pytest.raises(SpoolRefusal, match=message) as refused:
        job_arguments(text, me(), "x")
    assert "\n" not in str(refused.value)


def test_naming_the_owner_is_allowed() -> None:
    owner = me()
    args = job_arguments(f"command = 'true'\nuser = '{owner.pw_name}'\nuid = {owner.pw_uid}\n", owner, "x")
    assert args.command == ("true",)


def test_folders_others_can_write_need_the_sticky_bit(tmp_path: Path) -> None:
    folder = tmp_path / "spool"
    folder.mkdir()
    uid = os.geteuid()
    for mode in (0o1733, 0o1777, 0o700, 0o755):
        os.chmod(folder, mode)
        assert folder_problem(folder.stat(), uid) == "", oct(mode)
    for mode in (0o733, 0o777, 0o775):
        os.chmod(folder, mode)
        assert "no sticky bit" in folder_problem(folder.stat(), uid), oct(mode)
    assert "not to the daemon" in folder_problem(folder.stat(), uid + 1)


def test_unsafe_files_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "spool"
    folder.mkdir(mode=0o700)
    good = folder / "good.toml"
    good.write_text("command = 'true'\ncwd = '/'\n")
    os.chmod(good, 0o644)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        uid = os.geteuid()
        assert read_job_file(fd, "good.toml", uid).uid == uid
        assert owner_problem(good.stat(), uid) == ""
        os.chmod(good, 0o646)
        with pytest.raises(SpoolRefusal, match="others may write the file"):
            read_job_file(fd, "good.toml", uid)
        os.chmod(good, 0o644)
        (folder / "link.toml").symlink_to(good)
        with pytest.raises(SpoolRefusal, match="symbolic link"):
            read_job_file(fd, "link.toml", uid)
        os.link(good, folder / "hard.toml")
        with pytest.raises(SpoolRefusal, match="2 hard links"):
            read_job_file(fd, "hard.toml", uid)
        os.unlink(folder / "hard.toml")
        os.mkfifo(folder / "fifo.toml")
        with pytest.raises(SpoolRefusal, match="not a regular file"):
            read_job_file(fd, "fifo.toml", uid)
        (folder / "big.toml").write_text("# " + "x" * 70_000 + "\ncommand = 'true'\n")
        with pytest.raises(SpoolRefusal, match="larger than 64 KiB"):
            read_job_file(fd, "big.toml", uid)
        if uid == 0:
            os.chown(good, UNKNOWN_UID, UNKNOWN_UID)
            with pytest.raises(SpoolRefusal, match=f"uid {UNKNOWN_UID}, is not a user"):
                read_job_file(fd, "good.toml", uid)
        os.chmod(folder, 0o777)
        with pytest.raises(SpoolRefusal, match="no sticky bit"):
            read_job_file(fd, "good.toml", uid)
    finally:
        os.close(fd)


def test_a_done_folder_the_daemon_does_not_own_keeps_the_spool_off(tmp_path: Path) -> None:
    folder = tmp_path / "spool"
    folder.mkdir()
    os.chmod(folder, SPOOL_MODE)
    (tmp_path / "elsewhere").mkdir()
    (folder / DONE_DIR).symlink_to(tmp_path / "elsewhere")

    def never(caller: object, args: object) -> object:
        raise AssertionError("nothing may be submitted")

    spool = Spool(folder, never, lambda handled: None)  # type: ignore[arg-type]
    with pytest.raises(OSError):
        spool.start()
    spool.stop()
    (folder / DONE_DIR).unlink()
    (folder / DONE_DIR).mkdir(mode=0o777)
    os.chmod(folder / DONE_DIR, 0o777)
    with pytest.raises(SpoolRefusal, match="must belong to the daemon, writable by it alone"):
        spool.start()
    spool.stop()


async def test_a_folder_watch_reports_written_and_moved_in_files(tmp_path: Path) -> None:
    seen: asyncio.Queue[str] = asyncio.Queue()
    created: list[str] = []
    watch = FolderWatch(tmp_path, seen.put_nowait, created.append)
    watch.start()
    try:
        (tmp_path / "written.toml").write_text("x")
        assert await asyncio.wait_for(seen.get(), 10) == "written.toml"
        (tmp_path / ".hidden").write_text("y")
        assert await asyncio.wait_for(seen.get(), 10) == ".hidden"
        (tmp_path / ".hidden").rename(tmp_path / "moved.toml")
        assert await asyncio.wait_for(seen.get(), 10) == "moved.toml"
        (tmp_path / "sub").mkdir()
        (tmp_path / "sub" / "deeper.toml").write_text("z")
        (tmp_path / "last").write_text("w")
        assert await asyncio.wait_for(seen.get(), 10) == "last", "subfolders are not watched"
        assert created == ["written.toml", ".hidden", "last"]
    finally:
        watch.stop()
    (tmp_path / "after-stop").write_text("v")
    await asyncio.sleep(0.2)
    assert seen.empty()


# Daemon tests: real users, a real daemon, the real `sing`


def spool(daemon: Daemon) -> Path:
    return daemon.state_dir / "spool"


def drop_as(user: str, path: Path, text: str, mode: int = 0o644) -> None:
    """Write a file the way a user would: as that user, with their umask."""
    account = pwd.getpwnam(user)
    part = f"{path}.part"
    script = f"umask 022 && cat > '{part}' && chmod {mode:o} '{part}' && mv '{part}' '{path}'"
    subprocess.run(
        ["sh", "-c", script],
        input=text,
        text=True,
        check=True,
        user=account.pw_uid,
        group=account.pw_gid,
        cwd="/",
    )


def jobs(daemon: Daemon) -> list[dict[str, object]]:
    result = daemon.sing("ps", "-a", "-o", "json")
    assert result.code == 0, result.err
    listed: list[dict[str, object]] = result.json()
    return listed


def error_line(path: Path, timeout: float = 20.0) -> str:
    """The one line of the error file beside `path`, once it exists."""
    error = Path(str(path) + ".error")
    wait_until(error.exists, timeout)
    lines = error.read_text().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture
def spool_daemon(daemon_root: Path) -> Iterator[Daemon]:
    ensure_user(ALICE)
    ensure_user(BOB)
    with running_daemon(daemon_root, config={"metrics": False}) as daemon:
        yield daemon


@requires_root
def test_the_spool_folder_is_like_crontabs(spool_daemon: Daemon) -> None:
    folder = spool(spool_daemon).stat()
    assert stat.S_IMODE(folder.st_mode) == SPOOL_MODE and folder.st_uid == 0
    assert stat.S_IMODE((spool(spool_daemon) / DONE_DIR).stat().st_mode) == 0o711


@requires_root
def test_a_good_file_becomes_a_job_of_its_owner(spool_daemon: Daemon) -> None:
    daemon = spool_daemon
    alice = pwd.getpwnam(ALICE)
    drop_as(
        ALICE, spool(daemon) / "hello.toml", 'command = ["sh", "-c", "id -un; echo $HOME"]\ncwd = "/tmp"\n'
    )
    found = wait_until(lambda: [j for j in jobs(daemon) if j["name"] == "hello"])
    job = found[0]
    assert (job["user"], job["uid"]) == (ALICE, alice.pw_uid)
    assert daemon.sing("wait", str(job["id"])).code == 0
    assert daemon.sing("logs", str(job["id"])).out == f"{ALICE}\n{alice.pw_dir}\n"
    done = spool(daemon) / DONE_DIR / f"hello.{job['id']}.toml"
    wait_until(done.exists)
    assert done.stat().st_uid == alice.pw_uid
    assert stat.S_IMODE(done.stat().st_mode) == 0o600, "it may hold the job's environment"
    assert not (spool(daemon) / "hello.toml").exists()
    assert not (spool(daemon) / "hello.toml.error").exists()


@requires_root
def test_bad_files_get_an_error_file_and_submit_nothing(spool_daemon: Daemon) -> None:
    daemon = spool_daemon
    alice = pwd.getpwnam(ALICE)
    folder = spool(daemon)
    drop_as(ALICE, folder / "typo.toml", "command = 'true'\ngpu = 1\n")
    drop_as(ALICE, folder / "toomany.toml", "command = 'true'\ncwd = '/tmp'\ngpus = 99\n")
    drop_as(ALICE, folder / "open.toml", "command = 'true'\ncwd = '/tmp'\n", mode=0o666)
    drop_as(ALICE, folder / "nowhere.toml", "command = 'true'\ncwd = '/no/such/dir'\n")
    assert "unknown field 'gpu'" in error_line(folder / "typo.toml")
    assert "requested 99 devices but this machine has 4" in error_line(folder / "toomany.toml")
    assert "others may write the file (mode 666)" in error_line(folder / "open.toml")
    assert "/no/such/dir does not exist" in error_line(folder / "nowhere.toml")
    error = Path(str(folder / "typo.toml") + ".error").stat()
    assert (error.st_uid, stat.S_IMODE(error.st_mode)) == (alice.pw_uid, 0o600)
    assert (folder / "typo.toml").exists(), "a refused file stays for its owner to fix"
    assert jobs(daemon) == []
    drop_as(ALICE, folder / "typo.toml", "command = 'true'\ncwd = '/tmp'\n")
    fixed = wait_until(lambda: [j for j in jobs(daemon) if j["name"] == "typo"])
    wait_until(lambda: not Path(str(folder / "typo.toml") + ".error").exists())
    assert len(fixed) == 1 and fixed[0]["user"] == ALICE


@requires_root
def test_a_file_naming_another_user_is_refused(spool_daemon: Daemon) -> None:
    daemon = spool_daemon
    folder = spool(daemon)
    drop_as(BOB, folder / "as-alice.toml", f"command = 'true'\ncwd = '/tmp'\nuser = '{ALICE}'\n")
    drop_as(BOB, folder / "as-root.toml", "command = 'true'\ncwd = '/tmp'\nuid = 0\n")
    line = error_line(folder / "as-alice.toml")
    assert f"names {ALICE}, but a spooled job runs as the file's owner ({BOB})" in line
    assert "names uid 0" in error_line(folder / "as-root.toml")
    assert jobs(daemon) == []


@requires_root
def test_links_and_strangers_files_are_refused(spool_daemon: Daemon) -> None:
    daemon = spool_daemon
    folder = spool(daemon)
    bob = pwd.getpwnam(BOB)
    drop_as(ALICE, folder / "alice.toml", "command = 'true'\ncwd = '/tmp'\n")
    wait_until(lambda: jobs(daemon))

    def as_bob(*command: str) -> None:
        subprocess.run(command, user=bob.pw_uid, group=bob.pw_gid, check=True, cwd="/")

    as_bob("ln", "-s", "/etc/shadow", str(folder / "shadow.toml"))
    assert "symbolic link" in error_line(folder / "shadow.toml")
    drop_as(BOB, folder / ".own", "command = 'true'\ncwd = '/tmp'\n")
    as_bob("ln", str(folder / ".own"), str(folder / "hard.toml"))
    assert "2 hard links" in error_line(folder / "hard.toml")
    stranger = folder / ".stranger"
    stranger.write_text("command = 'true'\ncwd = '/tmp'\n")
    os.chown(stranger, UNKNOWN_UID, UNKNOWN_UID)
    stranger.rename(folder / "stranger.toml")
    assert f"uid {UNKNOWN_UID}, is not a user" in error_line(folder / "stranger.toml")
    assert [j["user"] for j in jobs(daemon)] == [ALICE]


@requires_root
def test_files_dropped_while_the_daemon_was_down_are_submitted_at_start(daemon_root: Path) -> None:
    ensure_user(ALICE)
    with running_daemon(daemon_root, config={"metrics": False}) as daemon:
        daemon.stop()
        drop_as(ALICE, spool(daemon) / "overnight.toml", "command = 'true'\ncwd = '/tmp'\n")
        daemon.start()
        found = wait_until(lambda: [j for j in jobs(daemon) if j["name"] == "overnight"])
        assert found[0]["user"] == ALICE


@requires_root
def test_a_file_with_the_longest_name_is_submitted_once(daemon_root: Path) -> None:
    """NAME.toml of 255 bytes: its error file's name and its done name were too long, so it
    stayed in the spool and was submitted again at every start (and the spool went off)."""
    ensure_user(ALICE)
    stem = "x" * (255 - len(".toml"))
    with running_daemon(daemon_root, config={"metrics": False}) as daemon:
        drop_as(ALICE, spool(daemon) / ".short", "command = 'true'\ncwd = '/tmp'\n")
        alice = pwd.getpwnam(ALICE)
        subprocess.run(["mv", ".short", f"{stem}.toml"], cwd=spool(daemon), user=alice.pw_uid, check=True)
        found = wait_until(lambda: jobs(daemon))
        assert [j["name"] for j in found] == [stem[:200]]
        wait_until(lambda: not (spool(daemon) / f"{stem}.toml").exists())
        daemon.stop()
        daemon.start()
        drop_as(ALICE, spool(daemon) / "later.toml", "command = 'true'\ncwd = '/tmp'\n")
        wait_until(lambda: len(jobs(daemon)) == 2)
        assert [j["name"] for j in jobs(daemon)] == [stem[:200], "later"]
