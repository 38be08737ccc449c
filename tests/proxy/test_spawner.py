"""The spawner starts proxy servers as the job's user, holding no capability, from a warm interpreter."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from singularity.proxy.spawner import SpawnerClient, SpawnError, SpawnRequest
from tests.proxy.conftest import base_env, proxy_env, run_program

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (starts processes as another user)")

NOBODY = pwd.getpwnam("nobody")


def status_fields(pid: int) -> dict[str, str]:
    """/proc/PID/status as a dict of its fields."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder under /tmp that every user can traverse (pytest's own tmp_path is root's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="sing-spawner-", dir="/tmp"))
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def spawner() -> Iterator[SpawnerClient]:
    client = SpawnerClient()
    yield client
    client.close()


def start_server_as_nobody(spawner: SpawnerClient, folder: Path) -> tuple[int, Path]:
    """A proxy server for one virtual device, started through the spawner as `nobody`."""
    folder.mkdir(mode=0o700)
    os.chown(folder, NOBODY.pw_uid, NOBODY.pw_gid)
    path = folder / "dev-0.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    listener.listen(16)
    try:
        pid = spawner.spawn(
            SpawnRequest(
                module="singularity.proxy.server",
                argv=[
                    "--socket",
                    str(path),
                    "--listen-fd",
                    "3",
                    "--device-index",
                    "0",
                    "--memory-bytes",
                    str(1 << 30),
                    "--threads",
                    "1",
                ],
                uid=NOBODY.pw_uid,
                gid=NOBODY.pw_gid,
                env={"OMP_NUM_THREADS": "1", "TMPDIR": str(folder)},
                fds={3: listener.fileno()},
                log_path=str(folder / "server.log"),
            )
        )
    finally:
        listener.close()
    return pid, path


def test_server_runs_as_the_user_with_no_capability(spawner: SpawnerClient, open_dir: Path) -> None:
    started = time.monotonic()
    pid, path = start_server_as_nobody(spawner, open_dir / "job")
    try:
        fields = status_fields(pid)
        assert fields["Uid"].split() == [str(NOBODY.pw_uid)] * 4
        assert fields["Gid"].split() == [str(NOBODY.pw_gid)] * 4
        assert fields["Groups"] == ""
        for capability_set in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(fields[capability_set], 16) == 0, capability_set
        assert fields["NoNewPrivs"] == "1"
        assert os.stat(f"/proc/{pid}/fd").st_uid == 0, "not dumpable: the user cannot ptrace it"
        env = proxy_env([path], "spawned")
        result = run_program(["mlp.py"], env)
        direct = run_program(["mlp.py"], base_env())
        assert result.returncode == 0, result.stderr
        assert result.stdout == direct.stdout
        print(f"spawned and served in {time.monotonic() - started:.2f}s")
    finally:
        os.kill(pid, 9)


def test_a_client_hanging_up_before_its_answer_cannot_kill_the_server(
    spawner: SpawnerClient, open_dir: Path
) -> None:
    """The server ignores SIGPIPE, as any Python process does: a control client that gives up (its
    timeout) before the answer makes the write fail, and the server lives on."""
    pid, _path = start_server_as_nobody(spawner, open_dir / "job")
    try:
        assert int(status_fields(pid)["SigIgn"], 16) & (1 << (signal.SIGPIPE - 1))
    finally:
        os.kill(pid, 9)


def test_bad_request_is_refused_and_spawner_lives_on(spawner: SpawnerClient, open_dir: Path) -> None:
    with pytest.raises(SpawnError, match="between 3 and 4096"):
        spawner.spawn(SpawnRequest("singularity.proxy.server", [], 65534, 65534, fds={1: 0}))
    pid, _ = start_server_as_nobody(spawner, open_dir / "again")
    os.kill(pid, 9)


def test_the_spawner_says_how_a_server_it_started_ended(spawner: SpawnerClient, open_dir: Path) -> None:
    """Only a parent learns how a process ended: the daemon, which watches the servers through a
    pidfd, saw a killed one only as ended, and a job's failure could not say its proxy was killed."""
    pid, _ = start_server_as_nobody(spawner, open_dir / "job")
    try:
        assert spawner.ended(pid) is None, "it still runs"
    finally:
        os.kill(pid, signal.SIGKILL)
    status = None
    deadline = time.monotonic() + 30
    while status is None and time.monotonic() < deadline:
        status = spawner.ended(pid)
        time.sleep(0.05)
    assert status is not None and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert spawner.ended(pid) is None, "told once"
    assert spawner.ended(1) is None, "not its child"


ORPHANING_DAEMON = """
import os, signal, sys, time
from singularity.proxy.spawner import SpawnerClient
client = SpawnerClient(preload=())
holder = os.fork()  # a process that keeps a copy of the daemon's end of the channel
if holder == 0:
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    time.sleep(120)
    os._exit(0)
print(client.process.pid, holder, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def ended(pid: int) -> bool:
    """Whether the process is gone (or a zombie waiting for its reaper)."""
    try:
        return status_fields(pid)["State"].startswith("Z")
    except FileNotFoundError:
        return True


def test_spawner_ends_when_the_daemon_dies_though_its_channel_lives_on() -> None:
    """A root spawner must not outlive its daemon, even when another process holds the channel."""
    daemon = subprocess.run(
        [sys.executable, "-c", ORPHANING_DAEMON], capture_output=True, text=True, timeout=120, check=False
    )
    spawner_pid, holder_pid = (int(word) for word in daemon.stdout.split())
    try:
        deadline = time.monotonic() + 60
        while not ended(spawner_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ended(spawner_pid), "the spawner outlived its daemon"
    finally:
        for pid in (holder_pid, spawner_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
