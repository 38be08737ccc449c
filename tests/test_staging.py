"""A short freeze: process images staged in memory, and CRIU's network lock only where TCP needs it.

Real CRIU, real process trees. A checkpoint taken in place through a staging area (a tmpfs, moved to
disk after the job runs again) restores to a byte-identical run; a staging tmpfs without room sends
the images straight to disk, saying so; a real daemon killed (at a fault point) while it moves a
checkpoint's images to disk restarts with that checkpoint removed, never used half-written, and its
job runs on to an exact end. A tree without TCP sockets is dumped without CRIU's network lock; one
with them under it, and a TCP connection found in a dump taken without it fails that checkpoint.
A dump that stops a tree holding no TCP socket skips the lock too; a connection that appeared
meanwhile makes CRIU let the tree run on, and it is dumped again under the lock.
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import sys
from pathlib import Path

import pytest

from singularityd import faults
from singularityd.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointResult,
    Criu,
    CriuInfo,
    ImageStore,
    service,
)
from singularityd.checkpoint.dump_script import TCP_STREAM_IMAGES
from singularityd.checkpoint.restoring import KnownDigests
from singularityd.checkpoint.staging import RECORD_NAME, StagingArea, staging_need
from tests.checkpoint_helpers import (
    COUNTER,
    HOLD,
    SYSTEM_PYTHON,
    TRAIN,
    LaunchedJob,
    finish_counting,
    finish_job,
    kill_tree,
    launch_job,
    pid_alive,
    small_tmpfs,
    track,
    wait_for_line,
    write_script,
)
from tests.conftest import requires_root
from tests.helpers import running_daemon, submit_counter, wait_until
from tests.test_pause import events


def crash_and_restore(cp: Checkpointer, name: str, job: LaunchedJob, jobs: list[int], release: Path) -> None:
    """Once the job printed line 100, kill it, restore its newest checkpoint and let it finish."""
    assert wait_for_line(job.log(), "100\n", 30)
    kill_tree(job.pid)
    restored = asyncio.run(cp.restore_latest(name))
    track(jobs, restored.pid)
    release.touch()
    finish_job(restored.pid, job)


def in_place(cp: Checkpointer, job: str, pid: int, log: Path) -> CheckpointResult:
    """Checkpoint a root-owned job in place, its log to be rewound on restore."""
    return asyncio.run(
        cp.checkpoint(job, pid, owner_uid=0, owner_gid=0, leave_running=True, rewind_paths=[str(log)])
    )


def test_staging_needs_room_beyond_the_expected_size() -> None:
    assert staging_need(0) == 64 << 20
    assert staging_need(400 << 20) == (500 + 64) << 20


@requires_root
def test_staged_checkpoint_restores_exactly(criu_info: CriuInfo, work: Path, jobs: list[int]) -> None:
    """Dumped to memory, moved to disk once the job ran again, restored after a crash: the output is
    byte-identical to an uninterrupted run, and nothing is left in the staging folder."""
    script = write_script(work, "train.py", TRAIN)
    steps, release = "300", work / "release"
    ref = launch_job(work, "ref", [sys.executable, script, steps, str(release)], jobs)
    job = launch_job(work, "run", [sys.executable, script, steps, str(release)], jobs)
    log = job.log()
    (work / "memory").mkdir()
    store = ImageStore(work / "store")
    staging = StagingArea.open(work / "memory", store.root)
    cp = Checkpointer(Criu(criu_info), store, staging=staging)
    assert wait_for_line(log, "step 5 ", 60)
    r = in_place(cp, "train", job.pid, log)
    assert r.staged and not r.staging_note and r.move_s > 0
    assert r.manifest.stats["staging"]["staged"] is True
    assert r.manifest.stats["network_locked"] is False, "a tree without TCP sockets needs no network lock"
    assert os.listdir(staging.root) == [], "the staged images were moved, not copied and left"
    assert any(name.endswith(".img") for name in os.listdir(r.path / "images"))
    for name in os.listdir(r.path / "images"):
        st = os.lstat(r.path / "images" / name)
        assert st.st_uid == 0 and not st.st_mode & 0o022, (name, oct(st.st_mode))
    assert stat.S_IMODE(os.lstat(staging.root).st_mode) == 0o700
    assert store.verify("train", r.seq).ok
    assert wait_for_line(log, "step 40 ", 60)
    kill_tree(job.pid)
    restored = asyncio.run(cp.restore_latest("train"))
    assert restored.seq == r.seq and restored.rewound
    track(jobs, restored.pid)
    release.touch()
    finish_job(restored.pid, job)
    finish_job(ref.pid, ref)
    expected = ref.log().read_bytes()
    assert b"checksum" in expected and log.read_bytes() == expected
    staging.close()
    assert not staging.root.exists() and not (store.root / RECORD_NAME).exists()


@requires_root
def test_staging_area_without_room_writes_to_disk(criu_info: CriuInfo, work: Path, jobs: list[int]) -> None:
    """A staging tmpfs smaller than the job's memory: the dump goes to disk, the result says why,
    and the checkpoint restores exactly."""
    with small_tmpfs(work / "small", "8m") as small:
        script = write_script(work, "count.py", COUNTER)
        release = work / "release"
        job = launch_job(work, "full", [SYSTEM_PYTHON, script, "200", str(release)], jobs)
        log = job.log()
        store = ImageStore(work / "store")
        cp = Checkpointer(Criu(criu_info), store, staging=StagingArea.open(small, store.root))
        assert wait_for_line(log, "5\n", 30)
        r = in_place(cp, "full", job.pid, log)
        assert not r.staged
        assert "free" in r.staging_note and "straight to disk" in r.staging_note, r.staging_note
        assert r.manifest.stats["staging"] == {"staged": False, "move_s": 0.0, "reason": r.staging_note}
        assert os.listdir(next(small.iterdir())) == []
        crash_and_restore(cp, "full", job, jobs, release)
        assert log.read_text() == "".join(f"{i}\n" for i in range(200)) + "done\n"


TCP_PAIR = (
    HOLD
    + """
import socket, sys, time
server = socket.create_server(("127.0.0.1", 0))
client = socket.create_connection(server.getsockname())
peer, _ = server.accept()
for i in range(int(sys.argv[1])):
    client.sendall(b"x")
    assert peer.recv(1) == b"x"
    print(i, flush=True)
    time.sleep(0.02)
hold(sys.argv[2])
print("done", flush=True)
"""
)


@requires_root
def test_network_lock_is_skipped_only_without_tcp(
    criu_info: CriuInfo, work: Path, jobs: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tree holding TCP connections is dumped under CRIU's network lock. Were one to appear in a
    dump taken without it (the tree held none when checked), the checkpoint fails and the job runs on."""
    script = write_script(work, "tcp.py", TCP_PAIR)
    release = work / "release"
    job = launch_job(work, "tcp", [SYSTEM_PYTHON, script, "300", str(release)], jobs)
    log = job.log()
    cp = Checkpointer(Criu(criu_info), ImageStore(work / "store"))
    assert wait_for_line(log, "5\n", 30)
    locked = in_place(cp, "tcp", job.pid, log)
    assert locked.manifest.stats["network_locked"] is True
    monkeypatch.setattr(service, "tree_holds_tcp", lambda pids: False)
    with pytest.raises(CheckpointError, match="opened a TCP connection while it was checkpointed"):
        in_place(cp, "tcp", job.pid, log)
    assert cp.store.seqs("tcp") == [locked.seq] and pid_alive(job.pid)
    crash_and_restore(cp, "tcp", job, jobs, release)
    assert log.read_text() == "".join(f"{i}\n" for i in range(300)) + "done\n"


def stop(cp: Checkpointer, job: str, pid: int, log: Path) -> CheckpointResult:
    """Checkpoint a root-owned job and stop it (a preemption), its log to be rewound on restore."""
    return asyncio.run(
        cp.checkpoint(job, pid, owner_uid=0, owner_gid=0, leave_running=False, rewind_paths=[str(log)])
    )


@requires_root
def test_a_stopping_dump_without_tcp_skips_the_lock_and_the_tree_is_gone_when_it_returns(
    criu_info: CriuInfo, work: Path, jobs: list[int]
) -> None:
    """A preemption of a tree holding no TCP socket: dumped without the network lock, the tree is
    gone when the checkpoint returns, and restored it ends exactly."""
    script = write_script(work, "count.py", COUNTER)
    release = work / "release"
    job = launch_job(work, "stopped", [SYSTEM_PYTHON, script, "200", str(release)], jobs)
    cp = Checkpointer(Criu(criu_info), ImageStore(work / "store"))
    assert wait_for_line(job.log(), "5\n", 30)
    r = stop(cp, "stopped", job.pid, job.log())
    assert r.manifest.stats["network_locked"] is False
    assert not pid_alive(job.pid), "the checkpoint returned with the job's tree still there"
    assert not list((r.path / "images").glob(TCP_STREAM_IMAGES))
    left_to_caller = KnownDigests(r.seq, {}, frozenset(r.manifest.files))
    assert not cp.restores_stopped
    with pytest.raises(ValueError, match="leaving the processes stopped"):
        asyncio.run(cp.restore_latest("stopped", known_digests=left_to_caller))
    restored = asyncio.run(cp.restore_latest("stopped"))
    finish_counting(restored.pid, job, jobs, release, 200)


@requires_root
def test_a_tcp_connection_in_a_stopping_dump_without_the_lock_has_it_dumped_again_under_the_lock(
    criu_info: CriuInfo, work: Path, jobs: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Were a TCP connection to appear in a stopping dump taken without the lock (the tree held none
    when checked), the dump's action script fails while the tree is frozen, CRIU lets it run on, and
    it is dumped again under the lock: the checkpoint says it was locked, the tree is gone, and
    restored the connection carries on to an exact end."""
    script = write_script(work, "tcp.py", TCP_PAIR)
    release = work / "release"
    job = launch_job(work, "tcp", [SYSTEM_PYTHON, script, "300", str(release)], jobs)
    cp = Checkpointer(Criu(criu_info), ImageStore(work / "store"))
    assert wait_for_line(job.log(), "5\n", 30)
    monkeypatch.setattr(service, "tree_holds_tcp", lambda pids: False)
    r = stop(cp, "tcp", job.pid, job.log())
    assert r.manifest.stats["network_locked"] is True
    assert not pid_alive(job.pid)
    assert list((r.path / "images").glob(TCP_STREAM_IMAGES))
    restored = asyncio.run(cp.restore_latest("tcp"))
    track(jobs, restored.pid)
    release.touch()
    finish_job(restored.pid, job)
    assert job.log().read_text() == "".join(f"{i}\n" for i in range(300)) + "done\n"


def staging_folder(state_dir: Path) -> Path:
    """The staging folder the daemon of this state directory records."""
    return Path((state_dir / "checkpoints" / RECORD_NAME).read_text().strip())


@pytest.mark.timeout(300)
@requires_root
def test_daemon_killed_while_moving_images_removes_that_checkpoint(
    daemon_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon dies (SIGKILL at a fault point) with a checkpoint's images half moved from memory
    to disk. Restarted, it removes that checkpoint and the old staging folder; the job, re-adopted,
    keeps its earlier complete checkpoint, takes new ones, and ends with an exact output."""
    release = daemon_root / "release"
    with running_daemon(daemon_root, virtual_devices=1, config={"checkpoint_staging": "/dev/shm"}) as daemon:
        job = submit_counter(daemon, release)
        daemon.wait_state(job, "RUNNING", timeout=60)
        log = daemon.state_dir / "jobs" / str(job) / "logs" / "rank-0.log"
        wait_until(lambda: log.exists() and "5\n" in log.read_text(), timeout=60)
        assert daemon.sing("checkpoint", str(job), timeout=120).code == 0
        assert any("process images staged in memory" in r for r in events(daemon, job)), events(daemon, job)
        old_staging = staging_folder(daemon.state_dir)
        assert old_staging.is_dir() and os.listdir(old_staging) == []

        daemon.stop()
        assert not old_staging.exists(), "a daemon that stops removes its staging folder"
        monkeypatch.setenv(faults.ENV, faults.STAGED_MOVE_RUNNING)
        daemon.start()
        monkeypatch.delenv(faults.ENV)
        assert daemon.sing("checkpoint", str(job), timeout=120).code != 0
        assert daemon.process is not None and daemon.process.wait(60) == -signal.SIGKILL
        daemon.process = None
        folder = daemon.state_dir / "checkpoints" / str(job)
        cut = folder / "00000002"
        assert not (cut / "manifest.json").exists() and (cut / ".staged.json").exists()
        half = staging_folder(daemon.state_dir)
        assert half != old_staging and not old_staging.exists()
        assert [p for p in half.rglob("*") if p.is_file()], "the fault came before the move ended"

        daemon.start()
        shown = daemon.wait_state(job, "RUNNING", timeout=60)
        reasons = [e["reason"] for e in shown["events"]]
        assert any("being moved from memory to disk when the daemon stopped" in r for r in reasons), reasons
        assert not cut.exists() and not half.exists()
        assert [c["seq"] for c in shown["checkpoint_list"]] == [1]
        assert daemon.sing("checkpoint", str(job), timeout=120).code == 0
        assert [c["seq"] for c in daemon.job(job)["checkpoint_list"]] == [1, 2]
        assert daemon.sing("preempt", str(job), timeout=120).code == 0
        daemon.wait_state(job, "RUNNING", timeout=120)
        release.touch()
        assert daemon.sing("wait", str(job), timeout=120).code == 0
        out = daemon.sing("logs", str(job)).out.splitlines()
    assert out[-1] == "end" and out[:-1] == [str(i) for i in range(len(out) - 1)]
