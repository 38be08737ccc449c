"""Bad input: one clear line on stderr, a documented non-zero exit, never a traceback."""

from __future__ import annotations

import os
import socket
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import requires_root
from tests.helpers import (
    SINGULARITYD,
    Daemon,
    Result,
    ensure_user,
    python_for_user,
    run_sing,
    running_daemon,
    wait_until,
)


def assert_one_line_error(result: Result, code: int, text: str) -> None:
    assert result.code == code, (result.code, result.err)
    assert "Traceback" not in result.err
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    assert text in lines[0], lines[0]
    assert result.out == ""


@pytest.mark.parametrize("command", [["show", "999"], ["cancel", "999"], ["logs", "999"], ["wait", "999"]])
def test_unknown_job_id(daemon: Daemon, command: list[str]) -> None:
    assert_one_line_error(daemon.sing(*command), 4, "sing: job 999 not found")


def test_more_gpus_than_the_machine_has(daemon: Daemon) -> None:
    result = daemon.sing("submit", "--gpus", "5", "--", "true")
    assert_one_line_error(result, 6, "requested 5 devices but this machine has 4")
    assert daemon.sing("ps", "-a", "--no-header").out == "", "a refused job is not queued"


@pytest.mark.parametrize(
    ("options", "text"),
    [
        (["--gpus", "0"], "--gpus must be at least 1, not 0"),
        (["--gpus", "-2"], "--gpus must be at least 1, not -2"),
        (["--ranks", "0"], "--ranks must be at least 1, not 0"),
        (["--ranks", "-3"], "--ranks must be at least 1, not -3"),
        (["--ranks", "4097"], "--ranks must be at most 4096, not 4097"),
        (["--env", "NOEQUALS"], "--env takes KEY=VALUE"),
        (["--cwd", "/no/such/dir"], "working directory /no/such/dir does not exist"),
        (["--cwd", "/etc/hostname"], "working directory /etc/hostname is not a directory"),
        (["--min-gpus", "0", "--max-gpus", "2", "--ranks", "2"], "--min-gpus must be at least 1, not 0"),
        (["--max-gpus", "-1", "--ranks", "2"], "--max-gpus must be at least 1, not -1"),
    ],
)
def test_bad_counts_and_options(daemon: Daemon, options: list[str], text: str) -> None:
    assert_one_line_error(daemon.sing("submit", *options, "--", "true"), 2, text)


@requires_root
def test_a_working_directory_the_user_cannot_enter_is_refused_at_submission(daemon: Daemon) -> None:
    """It was queued, and the job then failed as it started."""
    ensure_user("sing-alice")
    private = daemon.root / "private"
    private.mkdir(mode=0o700)
    refused = daemon.sing("submit", "--cwd", str(private), "--", "true", user="sing-alice")
    assert_one_line_error(refused, 2, f"cannot enter working directory {private}: permission denied")


@pytest.mark.parametrize("args", [["submit"], ["submit", "--"], ["submit", "--gpus", "1", "--"]])
def test_empty_command(daemon: Daemon, args: list[str]) -> None:
    assert_one_line_error(daemon.sing(*args), 2, "empty command")


@pytest.mark.parametrize(
    "command",
    [
        ["peers"],
        ["peers", "-o", "json"],
        ["drain"],
        ["undrain"],
        ["cluster", "token"],
        ["migrate", "1", "--to", "node-b"],
    ],
)
def test_cluster_verbs_outside_a_cluster(daemon: Daemon, command: list[str]) -> None:
    """Every verb that needs a lab cluster says the same thing, with the same exit, on a lone node."""
    daemon.submit("sleep", "30")
    text = "this node is in no lab cluster: run `sing cluster init` or `sing cluster join`"
    assert_one_line_error(daemon.sing(*command), 6, text)


def test_a_join_with_a_malformed_token_or_ca_hash_is_a_usage_error(daemon: Daemon) -> None:
    """They were sent to the CA node, which refused them (exit 6), or to no one when unreachable."""
    join = ("cluster", "join", "127.0.0.1:1")
    good_hash = "sha256:" + "ab" * 32
    refused = daemon.sing(*join, "--token", "secret", "--ca-hash", good_hash)
    assert_one_line_error(refused, 2, "--token: a join token looks like abcdef.0123456789abcdef")
    refused = daemon.sing(*join, "--token", "abcdef.0123456789abcdef", "--ca-hash", "sha256:abc")
    assert_one_line_error(refused, 2, "--ca-hash: a CA fingerprint looks like sha256:<64 hex digits>")


def test_job_names_and_commands_are_bounded_and_long_listings_still_arrive(daemon: Daemon) -> None:
    """Names of megabytes (a listing over gRPC's 4 MiB broke `sing ps` for every user) and control
    characters in names (they forged lines of `sing show`) are refused; listings of many long
    commands arrive whole."""
    too_long = daemon.sing("submit", "--name", "n" * 201, "--", "true")
    assert_one_line_error(too_long, 2, "at most 200 characters")
    refused = daemon.sing("submit", "--name", "a\nUser: sing-alice", "--", "true")
    assert_one_line_error(refused, 2, "must not hold control characters")
    too_big = daemon.sing("submit", "--", "true", *(["x" * 110_000] * 10))
    assert_one_line_error(too_big, 2, "at most 1048576 are kept")
    jobs = [daemon.submit("true", *(["y" * 110_000] * 9)) for _ in range(5)]  # about 5 MB in all
    for job in jobs:
        daemon.sing("wait", str(job))
    listed = daemon.sing("ps", "-a", "-o", "json")
    assert listed.code == 0, listed.err[-500:]
    assert [job["id"] for job in listed.json()] == jobs


def test_bad_output_format(daemon: Daemon) -> None:
    assert_one_line_error(daemon.sing("ps", "-o", "yaml"), 2, "-o must be one of table, wide, json")


def test_daemon_not_running(tmp_path: Path) -> None:
    missing = tmp_path / "nothing.sock"
    for args in (["ps"], ["submit", "--", "true"], ["devices"], ["show", "1"]):
        result = run_sing(args, socket_path=missing)
        assert_one_line_error(result, 3, f"cannot reach singularityd at {missing} (no such socket)")
        assert "start it with" in result.err
    stale = tmp_path / "stale.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(stale))
    listener.close()
    assert_one_line_error(run_sing(["ps"], socket_path=stale), 3, "cannot reach singularityd")
    waited = run_sing(["wait", "1"], socket_path=stale, timeout=20)  # it waited for ever, silently
    assert_one_line_error(waited, 3, "cannot reach singularityd")
    doctor = run_sing(["doctor"], socket_path=missing)
    assert doctor.code == 3 and "start it with" in doctor.out


def run_daemon(*args: str, user: str | None = None) -> subprocess.CompletedProcess[str]:
    command = [SINGULARITYD, *args]
    kwargs = {}
    if user is not None:
        python = python_for_user(user)
        if python is None:
            pytest.skip("no Python with this project importable by another user here")
        command = [*python, "-m", "singularityd", *args]
        kwargs = {"user": user, "cwd": "/tmp"}
    return subprocess.run(command, capture_output=True, text=True, timeout=60, **kwargs)  # type: ignore[call-overload, no-any-return]


def test_config_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("virtual_devices = [")
    result = run_daemon(
        "--config", str(bad), "--socket", str(tmp_path / "s.sock"), "--state-dir", str(tmp_path)
    )
    assert result.returncode == 2
    assert result.stderr.startswith(f"singularityd: config file {bad} is not valid TOML")
    assert len(result.stderr.strip().splitlines()) == 1
    result = run_daemon("--config", str(tmp_path), "--socket", str(tmp_path / "s.sock"))
    assert result.returncode == 2 and "it is a directory" in result.stderr
    result = run_daemon("--config", str(tmp_path / "absent.toml"))
    assert result.returncode == 2 and "does not exist" in result.stderr


@requires_root
def test_unreadable_config_file(daemon_root: Path) -> None:
    ensure_user("sing-alice")
    secret = daemon_root / "secret.toml"
    secret.write_text("virtual_devices = 2\n")
    os.chmod(secret, 0o600)
    result = run_daemon("--config", str(secret), user="sing-alice")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == f"singularityd: cannot read config file {secret}: permission denied"


@requires_root
def test_full_disk_under_the_state_directory(daemon_root: Path) -> None:
    """A full disk refuses new work with a clear error and loses nothing already stored."""
    state = daemon_root / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(state)], check=True)
    try:
        with running_daemon(daemon_root, config={"device_proxy": False}) as daemon:
            first = daemon.submit("true")
            assert daemon.sing("wait", str(first)).code == 0
            filler = state / "filler"
            subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k", "count=200"], capture_output=True)
            refused = daemon.sing("submit", "--", "sh", "-c", "echo " + "x" * 100_000)
            assert refused.code == 6, refused.err
            assert "cannot write its state database" in refused.err and "full" in refused.err
            assert "Traceback" not in refused.err and len(refused.err.strip().splitlines()) == 1
            filler.unlink()
            again = daemon.submit("true")
            assert daemon.sing("wait", str(again)).code == 0
            jobs = daemon.sing("ps", "-a", "-o", "json").json()
            assert [j["id"] for j in jobs] == [first, again] and {j["state"] for j in jobs} == {"COMPLETED"}
            assert stat.S_IMODE((state / "singularity.db").stat().st_mode) == 0o600, "specs hold users' env"
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)


def test_a_job_that_ends_while_the_state_database_is_locked_is_recorded_once_it_is_free(
    daemon: Daemon,
) -> None:
    """A job's end that the state database could not record (locked by another process here; a
    full disk does the same) was dropped: the job stayed RUNNING with its device, `sing wait`
    never returned and `cancel` did nothing. Its end is recorded, exit code included, after."""
    release = daemon.root / "release"
    job = daemon.submit("sh", "-c", f"while [ ! -e {release} ]; do sleep 0.1; done; exit 3")
    daemon.wait_state(job, "RUNNING")
    holder = sqlite3.connect(daemon.state_dir / "singularity.db", isolation_level=None)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        release.touch()
        wait_until(lambda: (daemon.state_dir / "jobs" / str(job) / "status.json").exists(), timeout=60)
        time.sleep(7)  # past the daemon's 5 s wait for the lock
    finally:
        holder.rollback()
        holder.close()
    waited = daemon.sing("wait", str(job), timeout=60)
    assert waited.code == 3, waited
    shown = daemon.job(job)
    assert shown["state"] == "FAILED" and shown["exit_code"] == 3 and shown["devices"] == []


@requires_root
def test_a_checkpoint_refused_by_a_full_state_database_is_taken_once_there_is_room(daemon_root: Path) -> None:
    """A checkpoint whose start the state database could not record (a full disk) is refused with
    a clear error and is not left under way: once there is room, the job checkpoints (it said
    "already being checkpointed" until the daemon restarted)."""
    state, images = daemon_root / "state", daemon_root / "images"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(state)], check=True)
    try:
        config = {"device_proxy": False, "checkpoint_dir": str(images), "checkpoint_pre_copy": 0}
        with running_daemon(daemon_root, config=config) as daemon:
            job = daemon.submit(sys.executable, "-c", "import time\nwhile True: time.sleep(0.1)")
            daemon.wait_state(job, "RUNNING")
            filler = state / "filler"
            subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k", "count=200"], capture_output=True)
            refused = daemon.sing("checkpoint", str(job))
            assert refused.code == 6 and "cannot write its state database" in refused.err, refused.err
            assert "Traceback" not in refused.err and len(refused.err.strip().splitlines()) == 1
            filler.unlink()
            taken = daemon.sing("checkpoint", str(job))
            assert taken.code == 0, taken.err
            assert daemon.job(job)["state"] == "RUNNING"
            daemon.sing("cancel", str(job))
            daemon.wait_state(job, "CANCELLED")
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)
