"""Jobs checkpointed and restored by real CRIU end exactly as uninterrupted ones: a training run
preempted, checkpointed in place and crashed; two ranks over TCP; copies restored beside the
original; a socket to a server outside the job swapped on restore; ranks of another user; pre-copy;
a PID still taken when a restore starts; a directory CRIU's parasite needs left by a dump killed.

The CRIU used is `locate_criu(os.environ.get("SINGULARITYD_TEST_CRIU", "auto"))`; tests that need
what it cannot do here (TCP sockets with CRIU < 4.2 on Linux >= 6.16, pre-dumps without kernel
dirty tracking) are skipped with the reason. A job that must still run when a checkpoint hits it
waits before its last line for the test's release file (the last argument of the scripts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from singularityd.checkpoint import CheckpointError, CheckpointUnavailable, Criu, CriuInfo, Manifest
from singularityd.checkpoint.criu_log import FORK_RETRY_PATTERN, PARASITE_PROC_DIR
from tests.checkpoint_helpers import (
    COUNTER,
    HOLD,
    SYSTEM_PYTHON,
    TEST_USER,
    TRAIN,
    LaunchedJob,
    checkpointer_in,
    children,
    counting_job,
    descendants,
    finish_counting,
    finish_job,
    kill_tree,
    launch_job,
    ns_pids,
    pid_alive,
    socket_inodes,
    track,
    wait_exit,
    wait_for_line,
    write_script,
)
from tests.conftest import requires_root
from tests.helpers import ensure_user, wait_until

ALLREDUCE = (
    HOLD
    + """
import sys, time
import torch, torch.distributed as dist
torch.set_num_threads(1)
steps = int(sys.argv[1])
dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the launcher
rank = dist.get_rank()
x = torch.zeros(4, dtype=torch.float64)
for step in range(steps):
    t = torch.full((4,), float(rank + step), dtype=torch.float64)
    dist.all_reduce(t)
    x += t
    print(step, int(x.sum().item()), flush=True)
    time.sleep(0.02)
hold(sys.argv[2])
dist.destroy_process_group()
print("done", flush=True)
"""
)

UNIX_CLIENT = (
    HOLD
    + """
import socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
for i in range(int(sys.argv[2])):
    s.sendall(f"{i}\\n".encode())
    print(i, flush=True)
    time.sleep(0.02)
hold(sys.argv[3])
print("done", flush=True)
"""
)


@requires_root
def test_exactness_torch_training(criu_info: CriuInfo, work: Path, jobs: list[int]) -> None:
    """Preempt/resume 5 times, checkpoint in place, crash and resume: output is byte-identical."""
    script = write_script(work, "train.py", TRAIN)
    py = sys.executable
    steps, release = "400", work / "release"
    ref = launch_job(work, "ref", [py, script, steps, str(release)], jobs)
    job = launch_job(work, "run", [py, script, steps, str(release)], jobs)
    log = job.log()
    cp = checkpointer_in(criu_info, work / "store", keep=2)
    seed = int(os.environ.get("SING_TEST_SEED", "20261129"))
    rng = random.Random(seed)
    plan = ["preempt", "inplace", "preempt", "preempt-precopy", "inplace", "preempt", "crash", "preempt"]
    assert wait_for_line(log, "step 5 ", 60)
    done: list[str] = []

    async def drive() -> int:
        cur = job.pid
        for op in plan:
            await asyncio.sleep(rng.uniform(0.1, 0.5))
            if op == "inplace":
                r = await cp.checkpoint(
                    "train", cur, owner_uid=0, owner_gid=0, leave_running=True, rewind_paths=[str(log)]
                )
                assert r.pause_s > 0
            elif op == "crash":
                taken = await cp.checkpoint(
                    "train", cur, owner_uid=0, owner_gid=0, leave_running=True, rewind_paths=[str(log)]
                )
                await asyncio.sleep(rng.uniform(0.2, 0.5))
                at_dump = taken.manifest.rewind_sizes[str(log)]
                for _ in range(600):  # a loaded machine may take longer to print the next step
                    if log.stat().st_size > at_dump:
                        break
                    await asyncio.sleep(0.05)
                kill_tree(cur)
                rr = await cp.restore_latest("train")
                assert rr.rewound, "log lines written after the checkpoint should be cut"
                cur = track(jobs, rr.pid)
            else:
                r = await cp.checkpoint(
                    "train",
                    cur,
                    owner_uid=0,
                    owner_gid=0,
                    leave_running=False,
                    pre_copy=1 if op.endswith("precopy") else 0,
                    rewind_paths=[str(log)],
                    extra={"op": op},
                )
                assert wait_exit(cur, 10)
                if op.endswith("precopy") and not criu_info.dirty_tracking:
                    assert "dirty tracking" in r.pre_copy_skipped
                rr = await cp.restore_latest("train")
                assert rr.seq == r.seq and rr.skipped == ()
                assert rr.manifest.extra == {"op": op}
                assert ns_pids(rr.pid)[-1] == 1
                cur = track(jobs, rr.pid)
            done.append(op)
        return cur

    final = asyncio.run(drive())
    assert done == plan
    release.touch()
    finish_job(final, job)
    finish_job(ref.pid, ref)
    out, expected = log.read_bytes(), ref.log().read_bytes()
    assert b"checksum" in expected
    assert out == expected, f"outputs differ (seed {seed})"


@requires_root
def test_two_rank_gloo_allreduce(criu_info: CriuInfo, work: Path, jobs: list[int]) -> None:
    """A 2-rank job with TCP between ranks and a listening TCPStore survives preempt/restore."""
    if criu_info.tcp_problem:
        pytest.skip(criu_info.tcp_problem)
    script = write_script(work, "allreduce.py", ALLREDUCE)
    steps, release = 300, work / "release"
    job = launch_job(work, "ar", [sys.executable, script, str(steps), str(release)], jobs, ranks=2)
    cp = checkpointer_in(criu_info, work / "store")
    assert wait_for_line(job.log(1), "\n20 ", 60)

    async def drive() -> int:
        cur = job.pid
        for op in ("preempt", "inplace", "preempt"):
            await asyncio.sleep(0.4)
            r = await cp.checkpoint("ar", cur, owner_uid=0, owner_gid=0, leave_running=op == "inplace")
            if op == "preempt":
                assert wait_exit(cur, 10)
                cur = track(jobs, (await cp.restore_latest("ar")).pid)
            assert r.image_bytes > 0
        return cur

    final = asyncio.run(drive())
    release.touch()
    status = finish_job(final, job)
    assert [(r["rank"], r["exit_code"]) for r in status["ranks"]] == [(0, 0), (1, 0)], status
    expected = "".join(f"{s} {4 * (s + 1) ** 2}\n" for s in range(steps)) + "done\n"
    for rank in range(2):
        assert job.log(rank).read_text() == expected


@requires_root
def test_restore_twice_while_original_runs(criu_info: CriuInfo, work: Path, jobs: list[int]) -> None:
    """Restores never need the original PIDs: two copies restore while the original runs."""
    job = counting_job(work, "twice", jobs, shown="3\n")
    pid, log = job.pid, job.log()
    cp = checkpointer_in(criu_info, work / "store")
    r = asyncio.run(cp.checkpoint("twice", pid, owner_uid=0, owner_gid=0, leave_running=True))
    orig_ns = ns_pids(pid)
    copies = []
    for _ in range(2):
        rr = asyncio.run(cp.restore("twice", r.seq, rewind=False))
        copies.append(track(jobs, rr.pid))
    assert pid_alive(pid) and all(pid_alive(c) for c in copies)
    assert len({pid, *copies}) == 3
    for c in copies:
        assert ns_pids(c)[-1] == orig_ns[-1] == 1
        (rank,) = children(c)
        assert ns_pids(rank)[-1] == ns_pids(children(pid)[0])[-1]
    size = log.stat().st_size
    wait_until(lambda: log.stat().st_size > size, timeout=30)


@requires_root
def test_external_unix_socket(criu_info: CriuInfo, work: Path, jobs: list[int]) -> None:
    """A socket to a server outside the tree (the device proxy's case) is swapped on restore."""
    path = str(work / "proxy.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen()
    conns: list[list[bytes]] = []

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            got: list[bytes] = []
            conns.append(got)
            threading.Thread(target=lambda c=c, got=got: _drain(c, got), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        script = write_script(work, "client.py", UNIX_CLIENT)
        release = work / "release"
        job = launch_job(work, "ux", [SYSTEM_PYTHON, script, path, "150", str(release)], jobs)
        pid, log = job.pid, job.log()
        assert wait_for_line(log, "5\n", 30)
        (rank,) = children(pid)
        (inode,) = socket_inodes(rank)
        cp = checkpointer_in(criu_info, work / "store")
        with pytest.raises(CheckpointError, match="external"):
            asyncio.run(
                Criu(criu_info).dump(pid, _mk(work / "no-ext"), log_file=work / "x.log", leave_running=True)
            )
        with pytest.raises(CheckpointError, match="external") as refused:
            asyncio.run(cp.checkpoint("ux", pid, owner_uid=0, owner_gid=0, leave_running=False))
        failed_log = refused.value.log_path
        assert failed_log is not None and failed_log.name.startswith("dump-00000001-failed-")
        assert pid_alive(pid)
        r = asyncio.run(
            cp.checkpoint(
                "ux", pid, owner_uid=0, owner_gid=0, leave_running=False, external_unix_inodes=[inode]
            )
        )
        assert r.manifest.external_unix_inodes == (inode,)
        assert (failed_log.parent / "dump-00000001.log").exists(), "the number is used again"
        assert "External socket is used" in failed_log.read_text(), "the failure's log is kept"
        fresh = socket.socket(socket.AF_UNIX)
        fresh.connect(path)

        def fds(m: Manifest) -> dict[str, int]:
            return {f"socket:[{i}]": fresh.fileno() for i in m.external_unix_inodes}

        rr = asyncio.run(cp.restore_latest("ux", inherit_fds=fds))
        fresh.close()
        finish_counting(rr.pid, job, jobs, release, 150)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (len(conns) == 2 and b"149\n" in b"".join(conns[1])):
            time.sleep(0.05)
        assert len(conns) == 2
        assert b"".join(conns[1]).endswith(b"149\n")
    finally:
        srv.close()


def _drain(c: socket.socket, got: list[bytes]) -> None:
    with c:
        while data := c.recv(4096):
            got.append(data)


def _mk(p: Path) -> Path:
    p.mkdir()
    return p


@requires_root
def test_ranks_of_another_user(criu_info: CriuInfo, work: Path, jobs: list[int]) -> None:
    """Ranks that dropped to the job's user: dumped where CRIU can, else a clear reason."""
    user = ensure_user(TEST_USER)
    release = work / "release"
    job = counting_job(work, "user", jobs, 120, user=user)
    pid = job.pid
    cp = checkpointer_in(criu_info, work / "store")
    caps = int(
        next(
            line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("CapEff:")
        ).split()[1],
        16,
    )
    if not caps >> 24 & 1:
        with pytest.raises(CheckpointError, match="CAP_SYS_RESOURCE"):
            asyncio.run(
                cp.checkpoint("user", pid, owner_uid=user.pw_uid, owner_gid=user.pw_gid, leave_running=False)
            )
        assert pid_alive(pid) and cp.store.seqs("user") == []
        return
    asyncio.run(cp.checkpoint("user", pid, owner_uid=user.pw_uid, owner_gid=user.pw_gid, leave_running=False))
    rr = asyncio.run(cp.restore_latest("user"))
    finish_counting(rr.pid, job, jobs, release, 120)


@requires_root
def test_pre_copy(criu_info: CriuInfo, work: Path, jobs: list[int]) -> None:
    """With dirty tracking, pre-dumps then a short final dump; without, a clear reason."""
    release = work / "release"
    job = counting_job(work, "pre", jobs, 150)
    pid = job.pid
    cp = checkpointer_in(criu_info, work / "store")
    if not criu_info.dirty_tracking:
        with pytest.raises(CheckpointUnavailable, match="dirty tracking"):
            asyncio.run(Criu(criu_info).pre_dump(pid, work, log_file=work / "p.log"))
        r = asyncio.run(cp.checkpoint("pre", pid, owner_uid=0, owner_gid=0, leave_running=True, pre_copy=2))
        assert "dirty tracking" in r.pre_copy_skipped
        assert r.pre_dumps == ()
        assert pid_alive(pid)
        return
    r = asyncio.run(cp.checkpoint("pre", pid, owner_uid=0, owner_gid=0, leave_running=False, pre_copy=2))
    assert len(r.pre_dumps) == 2 and r.manifest.pre_dumps == ("pre-1", "pre-2")
    assert r.dump.pages_skipped_parent > 0
    rr = asyncio.run(cp.restore_latest("pre"))
    finish_counting(rr.pid, job, jobs, release, 150)


@requires_root
def test_restore_retries_while_pid_is_taken(criu_info: CriuInfo, work: Path) -> None:
    """Without a PID namespace the old PID must be free: restore retries until it is reaped."""
    script = write_script(work, "count.py", COUNTER)
    log, release = work / "zombie.log", work / "release"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [SYSTEM_PYTHON, script, "100", str(release)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            start_new_session=True,
        )
    restored = -1
    try:
        assert wait_for_line(log, "2\n", 30)
        cp = checkpointer_in(criu_info, work / "store")
        asyncio.run(cp.checkpoint("z", proc.pid, owner_uid=0, owner_gid=0, leave_running=False))
        assert not pid_alive(proc.pid)

        def reap_once_restore_was_refused() -> None:
            """Reap the dumped process only after a restore attempt failed on its PID."""
            logs = cp.store.logs_dir("z")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if any(
                    FORK_RETRY_PATTERN in p.read_text(errors="replace") for p in logs.glob("restore-*.log")
                ):
                    break
                time.sleep(0.01)
            proc.wait()

        reaper = threading.Thread(target=reap_once_restore_was_refused)
        reaper.start()
        rr = asyncio.run(cp.restore_latest("z"))
        restored = rr.pid
        reaper.join()
        assert rr.pid == proc.pid
        assert rr.outcome.attempts > 1
        release.touch()
        assert wait_exit(rr.pid, 30)
        assert log.read_text() == "".join(f"{i}\n" for i in range(100)) + "done\n"
    finally:
        if restored > 0:
            kill_tree(restored)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


@requires_root
def test_a_dump_gets_past_the_parasite_directory_a_killed_dump_left(
    criu_info: CriuInfo, work: Path, jobs: list[int]
) -> None:
    """The job's init works in /, where CRIU's parasite makes its proc directory for a job whose
    /proc is the machine's; one left by a killed dump is removed and the job checkpointed."""
    job = counting_job(work, "left", jobs, 300)
    assert os.readlink(f"/proc/{job.pid}/cwd") == "/"
    stale = Path("/") / PARASITE_PROC_DIR
    wait_until(lambda: not stale.exists(), timeout=30)  # a dump of another test may hold it now
    stale.mkdir(mode=0o700)
    try:
        cp = checkpointer_in(criu_info, work / "store")
        r = asyncio.run(cp.checkpoint("left", job.pid, owner_uid=0, owner_gid=0, leave_running=False))
        assert not stale.exists()
        assert wait_exit(job.pid, 10)
        rr = asyncio.run(cp.restore_latest("left"))
        assert rr.seq == r.seq
        finish_counting(rr.pid, job, jobs, work / "release", 300)
    finally:
        with contextlib.suppress(FileNotFoundError):
            stale.rmdir()


ENDING_LATER = """
import ctypes, os, sys, threading, time
def end_later():
    time.sleep(float(sys.argv[1]))
    os._exit(0)
threading.Thread(target=end_later).start()
ctypes.CDLL(None).pthread_exit(None)
"""
"""A process whose main thread ends at once while another thread ends the process `argv[1]` s
later: meanwhile the kernel shows it as a zombie with threads, as a process caught ending is."""

PARENT_OF_ENDING = (
    HOLD
    + """
import subprocess, sys
child = subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2]])
print("child", flush=True)
print("reaped", child.wait(), flush=True)
hold(sys.argv[3])
print("done", flush=True)
"""
)


def _ending_child(work: Path, name: str, jobs: list[int], seconds: float) -> LaunchedJob:
    """A job whose rank starts an ENDING_LATER child, returned once that child is a zombie with
    threads."""
    parent = write_script(work, "parent.py", PARENT_OF_ENDING)
    ending = write_script(work, "ending.py", ENDING_LATER)
    job = launch_job(work, name, [SYSTEM_PYTHON, parent, ending, str(seconds), str(work / "release")], jobs)

    def zombie_with_threads() -> bool:
        for pid in descendants(job.pid):
            with contextlib.suppress(OSError):
                status = Path(f"/proc/{pid}/status").read_text()
                if "\nState:\tZ" in status and "\nThreads:\t1\n" not in status:
                    return True
        return False

    wait_until(zombie_with_threads, timeout=30)
    return job


@requires_root
def test_a_process_caught_ending_is_dumped_once_it_has_ended(
    criu_info: CriuInfo, work: Path, jobs: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    """CRIU refuses a process whose main thread has ended while its other threads have not (a
    DataLoader worker ending at an epoch's end); the dump is taken again until it has ended, and
    the job, preempted meanwhile, goes on as if never stopped."""
    caplog.set_level(logging.INFO, logger="singularityd.checkpoint.criu")
    job = _ending_child(work, "ending", jobs, 0.6)
    cp = checkpointer_in(criu_info, work / "store")
    r = asyncio.run(cp.checkpoint("ending", job.pid, owner_uid=0, owner_gid=0, leave_running=False))
    assert "Zombies with threads" in caplog.text and "trying again" in caplog.text
    assert wait_exit(job.pid, 10)
    rr = asyncio.run(cp.restore_latest("ending"))
    assert rr.seq == r.seq
    track(jobs, rr.pid)
    (work / "release").touch()
    assert wait_exit(rr.pid, 30)
    assert job.log().read_text() == "child\nreaped 0\ndone\n"


@requires_root
def test_a_process_whose_main_thread_ended_long_ago_fails_the_dump_clearly(
    criu_info: CriuInfo, work: Path, jobs: list[int]
) -> None:
    """A main thread that called pthread_exit while others run on for good is refused after every
    try, with CRIU's reason in words, and the job runs on."""
    job = _ending_child(work, "stays", jobs, 300)
    cp = checkpointer_in(criu_info, work / "store")
    with pytest.raises(CheckpointError, match="main thread had ended while its other threads ran on"):
        asyncio.run(cp.checkpoint("stays", job.pid, owner_uid=0, owner_gid=0, leave_running=False))
    assert pid_alive(job.pid)
    assert job.log().read_text() == "child\n"


@requires_root
def test_a_restore_whose_mounts_cannot_be_prepared_says_why(criu_info: CriuInfo, work: Path) -> None:
    """A job dumped with its own mounts is restored through a mount yard; a mount point the
    checkpoint names that this machine lacks fails the restore with the wrapper's reason, not an
    empty CRIU log."""
    images = work / "images"
    images.mkdir()
    with pytest.raises(CheckpointError) as failed:
        asyncio.run(
            Criu(criu_info).restore(
                images,
                log_file=work / "restore.log",
                pidfile=work / "restore.pid",
                external_mounts={"m0": str(work / "no-such-mount-point")},
                mount_yard=work / "yard",
            )
        )
    assert "cannot prepare the job's mounts for CRIU" in str(failed.value), failed.value
    assert "no-such-mount-point" not in os.listdir(work)
