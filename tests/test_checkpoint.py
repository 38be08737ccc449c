"""Tests of the checkpoint layer: pure decisions first, then real process trees and real CRIU.

The CRIU used is `locate_criu(os.environ.get("SINGULARITYD_TEST_CRIU", "auto"))`; tests that need
what it cannot do here (TCP sockets with CRIU < 4.2 on Linux >= 6.16, pre-dumps without kernel
dirty tracking) are skipped with the reason. Jobs are started by the daemon's own launcher; a job
that must still run when a checkpoint hits it waits before its last line for the test's release
file (the last argument of the scripts below).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import pwd
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from singularityd.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointUnavailable,
    Criu,
    CriuError,
    CriuInfo,
    FileRecord,
    ImageStore,
    Manifest,
    NoValidCheckpoint,
    Verdict,
    locate_criu,
)
from singularityd.checkpoint import store as store_module
from singularityd.checkpoint.criu import (
    FORK_RETRY_PATTERN,
    parse_stats,
    parse_version,
    privilege_problem,
    summarize_log,
    tcp_problem,
)
from singularityd.checkpoint.manifest import (
    FileFact,
    ManifestError,
    choose_latest,
    digest_problems,
    plan_prune,
    structural_problems,
)
from singularityd.checkpoint.precheck import DaemonFacts, ProcFacts, tree_problems
from singularityd.checkpoint.service import parse_sizes, post_dump_script
from singularityd.checkpoint.store import hash_file, hash_files, hash_prefixes
from tests.checkpoint_helpers import (
    LaunchedJob,
    children,
    kill_tree,
    ns_pids,
    pid_alive,
    small_tmpfs,
    socket_inodes,
    start_job,
    wait_exit,
    wait_for_line,
)
from tests.helpers import ensure_user, wait_until

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="needs root (CRIU, PID namespaces, users)")
SYSTEM_PYTHON = "/usr/bin/python3"
T = TypeVar("T")
TEST_USER = "sing-test-job"
OTHER_USER = "sing-test-other"

HOLD = """
def hold(path):
    import os, time
    while not os.path.exists(path):
        time.sleep(0.05)
"""

TRAIN = (
    HOLD
    + """
import hashlib, sys, time
import torch
torch.set_num_threads(1)
torch.manual_seed(1234)
steps = int(sys.argv[1])
X = torch.randn(512, 64)
y = X @ torch.randn(64, 1) + 0.1 * torch.randn(512, 1)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
for step in range(steps):
    idx = torch.randint(0, 512, (64,))
    loss = torch.nn.functional.mse_loss(model(X[idx]), y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.10f}", flush=True)
    time.sleep(0.02)
hold(sys.argv[2])
h = hashlib.sha256()
for p in model.parameters():
    h.update(p.detach().numpy().tobytes())
print("checksum", h.hexdigest(), flush=True)
"""
)

COUNTER = (
    HOLD
    + """
import sys, time
for i in range(int(sys.argv[1])):
    print(i, flush=True)
    time.sleep(0.02)
hold(sys.argv[2])
print("done", flush=True)
"""
)

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


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion (tests drive the async API from sync code)."""
    return asyncio.run(coro)


# ---------------------------------------------------------------- pure logic


def _manifest(seq: int = 2, **files: int) -> Manifest:
    recs = {f"images/{k}.img": FileRecord(size=v, sha256=f"h{k}") for k, v in files.items()}
    return Manifest(
        job_id="j1",
        seq=seq,
        created_at=1.0,
        owner_uid=1000,
        leave_running=True,
        criu_version="4.2.1",
        files=recs,
        links={"images/parent": "../pre-1"},
        pre_dumps=("pre-1",),
        external_unix_inodes=(77,),
        rewind_sizes={"/l/r0.log": 10},
        extra={"step": 5},
    )


def test_manifest_roundtrip_and_total() -> None:
    m = _manifest(core=10, pages=90)
    again = Manifest.from_json(m.to_json())
    assert again == m
    assert again.total_bytes == 100
    assert m.to_json() == again.to_json()


@pytest.mark.parametrize("text", ["", "[]", "{}", '{"format": 1}', '{"format": 1, "files": 3}'])
def test_manifest_rejects_garbage(text: str) -> None:
    with pytest.raises(ManifestError):
        Manifest.from_json(text)


def test_structural_problems() -> None:
    m = _manifest(core=10, pages=90)
    good = {
        "images/core.img": FileFact("file", 0, 10),
        "images/pages.img": FileFact("file", 0, 90),
        "images/parent": FileFact("symlink", 0, 0, "../pre-1"),
        "images": FileFact("dir", 0),
    }
    assert structural_problems(m, good, expected_job="j1", expected_seq=2, trusted_uid=0) == []
    bad = dict(good)
    bad["images/core.img"] = FileFact("file", 1000, 10)
    bad["images/pages.img"] = FileFact("file", 0, 89)
    bad["images/parent"] = FileFact("symlink", 0, 0, "/etc")
    bad["images"] = FileFact("dir", 1000)
    problems = structural_problems(m, bad, expected_job="j1", expected_seq=3, trusted_uid=0)
    text = "\n".join(problems)
    assert "checkpoint 2, found in job j1 checkpoint 3" in text
    assert "owned by uid 1000" in text
    assert "89 bytes" in text
    assert "not the link" in text
    assert "directory images is owned" in text
    m2 = Manifest(**{**m.__dict__, "files": {"../x": FileRecord(1, "h")}})
    assert any(
        "unsafe" in p for p in structural_problems(m2, {}, expected_job="j1", expected_seq=2, trusted_uid=0)
    )


def test_digest_choice_and_prune() -> None:
    m = _manifest(core=10, pages=90)
    assert digest_problems(m, {"images/core.img": "hcore", "images/pages.img": "hpages"}) == []
    assert digest_problems(m, {"images/core.img": "hcore", "images/pages.img": "x"}) == [
        "images/pages.img fails its sha256 check"
    ]
    vs = [
        Verdict.good(1),
        Verdict.good(2),
        Verdict.bad(3, ["a", "b", "c", "d"]),
        Verdict.bad(4, ["incomplete"]),
    ]
    choice = choose_latest(vs)
    assert choice.seq == 2
    assert [(s.seq, s.reason) for s in choice.skipped] == [(4, "incomplete"), (3, "a; b; c (and 1 more)")]
    assert choose_latest([Verdict.bad(1, ["x"])]).seq is None
    assert plan_prune(vs, keep=1) == [1, 3, 4]
    assert plan_prune(vs, keep=5) == [3, 4]
    assert plan_prune(vs, keep=0) == [1, 3, 4]
    assert plan_prune([Verdict.bad(1, ["x"]), Verdict.bad(2, ["y"])], keep=1) == []


def test_version_kernel_privilege_and_log_summaries() -> None:
    assert parse_version("Version: 4.1.1\n") == (4, 1, 1)
    assert parse_version("nothing") is None
    assert "CRIU 4.2 or newer" in tcp_problem((4, 1, 1), (6, 18))
    assert tcp_problem((4, 2, 1), (6, 18)) == ""
    assert tcp_problem((4, 1, 1), (6, 8)) == ""
    assert "user mode" in privilege_problem(1000)
    assert privilege_problem(0) == ""
    with pytest.raises(CheckpointUnavailable, match="user mode"):
        locate_criu("auto", euid=1000)
    with pytest.raises(CheckpointUnavailable, match="turned off"):
        locate_criu("off", euid=0)
    with pytest.raises(CheckpointUnavailable, match="not an executable"):
        locate_criu("/nonexistent/criu", euid=0)
    log = (
        "(00.02) Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE for self: x\n"
        "(00.03) Error (criu/cr-dump.c:1): Dump files (pid: 5) failed with -1\n"
    )
    assert summarize_log(log) == "Dump files (pid: 5) failed with -1"
    full = log + "(00.04) Error (criu/image.c:9): Unable to write: No space left on device\n"
    assert summarize_log(full).startswith("no space left on the device")
    assert summarize_log("") == "CRIU failed without an error line in its log"
    stats = parse_stats(
        "Displaying dump stats:\nFrozen time: 950655 us\nMemory pages written: 76027 (0x128fb)\n"
    )
    assert stats == {"frozen_time": 950655, "memory_pages_written": 76027}


def test_tree_problems() -> None:
    init = ProcFacts(10, "python", (1000, 1000, 1000, 1000), (1000,) * 4, (10, 1))
    rank = ProcFacts(
        11,
        "python",
        (1000,) * 4,
        (1000,) * 4,
        (11, 2),
        ("anon_inode:[io_uring]", "socket:[55]"),
        frozenset({55}),
    )
    lacking = DaemonFacts(uid=0, gid=0, have_cap_sys_resource=False, userns_problem="no user namespaces")
    problems = tree_problems([init, rank], lacking, tcp_problem_text="old CRIU")
    text = "\n".join(problems)
    assert "must be root" not in text and "CRIU needs it to be root" in text
    assert "CAP_SYS_RESOURCE" in text and "(no user namespaces)" in text
    assert "io_uring" in text
    assert "TCP sockets: old CRIU" in text
    root_init = ProcFacts(10, "python", (0,) * 4, (0,) * 4, (10, 1))
    assert tree_problems([root_init], lacking, tcp_problem_text="") == []
    full = DaemonFacts(uid=0, gid=0, have_cap_sys_resource=True)
    assert tree_problems([], full, tcp_problem_text="") == ["the job's root process does not exist"]
    assert tree_problems([root_init, rank], full, tcp_problem_text="") == [
        "process 11 (python) uses io_uring, which CRIU cannot checkpoint "
        "(for torch.distributed set USE_LIBUV=0 so its TCPStore does not use libuv)"
    ]


def test_a_file_hashed_in_two_goes_hashes_as_a_whole(tmp_path: Path) -> None:
    """The beginning of an append-only file hashed while the job runs, the rest at the manifest:
    the same sha256 as hashing it all then; a file that shrank is hashed afresh."""
    folder = tmp_path / "images" / "proxy"
    folder.mkdir(parents=True)
    state = folder / "cuda0.state"
    state.write_bytes(os.urandom(5 * (1 << 20) + 3))
    prefixes = hash_prefixes(tmp_path / "images", tmp_path)
    assert list(prefixes) == ["images/proxy/cuda0.state"]
    with state.open("ab") as out:
        out.write(os.urandom(3 * (1 << 20) + 7))
    whole = hashlib.sha256(state.read_bytes()).hexdigest()
    assert hash_files(tmp_path, ["images/proxy/cuda0.state"], prefixes=prefixes) == {
        "images/proxy/cuda0.state": (8 * (1 << 20) + 10, whole)
    }
    state.write_bytes(b"short")
    assert hash_file(state, prefixes["images/proxy/cuda0.state"]) == (5, hashlib.sha256(b"short").hexdigest())


def test_a_daemon_killed_while_recording_a_stopping_dump_leaves_it_recordable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The intent of a dump that stops the job stays until the manifest is durable: a daemon that
    dies while `finish` hashes the images (CRIU done, the job's processes gone) leaves a checkpoint
    its restart finds and records; a stale intent beside a manifest is cleared."""
    store = ImageStore(tmp_path / "store")
    uid, gid = os.getuid(), os.getgid()
    pending = store.begin("7", owner_uid=uid, owner_gid=gid)
    store.record_intent(pending, {"criu_version": "4.2"})
    (pending.path / "images" / "core-1.img").write_bytes(b"image")

    def killed(*args: object, **kwargs: object) -> None:
        raise SystemExit("killed while hashing")

    monkeypatch.setattr(store_module, "hash_files", killed)
    with pytest.raises(SystemExit):
        store.finish(pending, leave_running=False, criu_version="4.2")
    monkeypatch.undo()
    found = store.interrupted("7")
    assert found is not None and found[0].seq == pending.seq and found[1]["criu_version"] == "4.2"
    store.finish(pending, leave_running=False, criu_version="4.2")
    assert not (pending.path / ".intent.json").exists()
    store.record_intent(pending, {"criu_version": "4.2"})  # as if killed just after the manifest
    assert store.interrupted("7") is None and not (pending.path / ".intent.json").exists()


def test_post_dump_script_records_sizes(tmp_path: Path) -> None:
    a = tmp_path / "a b.log"
    a.write_bytes(b"12345")
    out = tmp_path / "sizes"
    script = tmp_path / "s.sh"
    paths = [str(a), str(tmp_path / "missing")]
    script.write_text(post_dump_script(paths, out))
    script.chmod(0o700)
    subprocess.run([str(script)], env={"CRTOOLS_SCRIPT_ACTION": "pre-dump"}, check=True)
    assert not out.exists()
    subprocess.run([str(script)], env={"CRTOOLS_SCRIPT_ACTION": "post-dump"}, check=True)
    assert parse_sizes(paths, out.read_text()) == {str(a): 5, str(tmp_path / "missing"): -1}


# ---------------------------------------------------------------- real CRIU


def _as_user(user: pwd.struct_passwd, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", *argv],
        capture_output=True,
        text=True,
        check=False,
    )


def _checkpointer(info: CriuInfo, root: Path, keep: int = 3) -> Checkpointer:
    return Checkpointer(Criu(info), ImageStore(root), keep=keep)


def _script(work: Path, name: str, text: str) -> str:
    p = work / name
    p.write_text(text)
    p.chmod(0o644)
    return str(p)


def _job_env() -> dict[str, str]:
    return {
        "PATH": "/usr/bin:/bin",
        "USE_LIBUV": "0",
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }


def _launch(
    work: Path,
    name: str,
    command: list[str],
    jobs: list[int],
    *,
    ranks: int = 1,
    user: pwd.struct_passwd | None = None,
) -> LaunchedJob:
    """Start `command` as a job (as `user`, else root) with the daemon's launcher; kill it at the end."""
    uid, gid, login = (user.pw_uid, user.pw_gid, user.pw_name) if user else (0, 0, "root")
    job = run(
        start_job(work / name, command, ranks=ranks, uid=uid, gid=gid, user=login, env=_job_env(), cwd=work)
    )
    jobs.append(job.pid)
    return job


def _track(jobs: list[int], pid: int) -> int:
    jobs.append(pid)
    return pid


def _finish(pid: int, job: LaunchedJob, timeout: float = 60) -> dict[str, Any]:
    """Wait for the job's (possibly restored) supervisor to end; its status, which must be success."""
    assert wait_exit(pid, timeout), f"job {pid} did not finish"
    status = job.status()
    assert (status["exit_code"], status["signal"]) == (0, None), status
    return status


@needs_root
def test_exactness_torch_training(criu_info: CriuInfo, work: Path, jobs: list[int]) -> None:
    """Preempt/resume 5 times, checkpoint in place, crash and resume: output is byte-identical."""
    script = _script(work, "train.py", TRAIN)
    py = sys.executable
    steps, release = "400", work / "release"
    ref = _launch(work, "ref", [py, script, steps, str(release)], jobs)
    job = _launch(work, "run", [py, script, steps, str(release)], jobs)
    log = job.log()
    cp = _checkpointer(criu_info, work / "store", keep=2)
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
                await cp.checkpoint(
                    "train", cur, owner_uid=0, owner_gid=0, leave_running=True, rewind_paths=[str(log)]
                )
                await asyncio.sleep(rng.uniform(0.2, 0.5))
                kill_tree(cur)
                rr = await cp.restore_latest("train")
                assert rr.rewound, "log lines written after the checkpoint should be cut"
                cur = _track(jobs, rr.pid)
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
                cur = _track(jobs, rr.pid)
            done.append(op)
        return cur

    final = run(drive())
    assert done == plan
    release.touch()
    _finish(final, job)
    _finish(ref.pid, ref)
    out, expected = log.read_bytes(), ref.log().read_bytes()
    assert b"checksum" in expected
    assert out == expected, f"outputs differ (seed {seed})"


@needs_root
def test_two_rank_gloo_allreduce(criu_info: CriuInfo, work: Path, jobs: list[int]) -> None:
    """A 2-rank job with TCP between ranks and a listening TCPStore survives preempt/restore."""
    if criu_info.tcp_problem:
        pytest.skip(criu_info.tcp_problem)
    script = _script(work, "allreduce.py", ALLREDUCE)
    steps, release = 300, work / "release"
    job = _launch(work, "ar", [sys.executable, script, str(steps), str(release)], jobs, ranks=2)
    cp = _checkpointer(criu_info, work / "store")
    assert wait_for_line(job.log(1), "\n20 ", 60)

    async def drive() -> int:
        cur = job.pid
        for op in ("preempt", "inplace", "preempt"):
            await asyncio.sleep(0.4)
            r = await cp.checkpoint("ar", cur, owner_uid=0, owner_gid=0, leave_running=op == "inplace")
            if op == "preempt":
                assert wait_exit(cur, 10)
                cur = _track(jobs, (await cp.restore_latest("ar")).pid)
            assert r.image_bytes > 0
        return cur

    final = run(drive())
    release.touch()
    status = _finish(final, job)
    assert [(r["rank"], r["exit_code"]) for r in status["ranks"]] == [(0, 0), (1, 0)], status
    expected = "".join(f"{s} {4 * (s + 1) ** 2}\n" for s in range(steps)) + "done\n"
    for rank in range(2):
        assert job.log(rank).read_text() == expected


@needs_root
def test_restore_twice_while_original_runs(criu_info: CriuInfo, work: Path, jobs: list[int]) -> None:
    """Restores never need the original PIDs: two copies restore while the original runs."""
    script = _script(work, "count.py", COUNTER)
    release = work / "release"
    job = _launch(work, "twice", [SYSTEM_PYTHON, script, "100000", str(release)], jobs)
    pid, log = job.pid, job.log()
    assert wait_for_line(log, "3\n", 30)
    cp = _checkpointer(criu_info, work / "store")
    r = run(cp.checkpoint("twice", pid, owner_uid=0, owner_gid=0, leave_running=True))
    orig_ns = ns_pids(pid)
    copies = []
    for _ in range(2):
        rr = run(cp.restore("twice", r.seq, rewind=False))
        copies.append(_track(jobs, rr.pid))
    assert pid_alive(pid) and all(pid_alive(c) for c in copies)
    assert len({pid, *copies}) == 3
    for c in copies:
        assert ns_pids(c)[-1] == orig_ns[-1] == 1
        (rank,) = children(c)
        assert ns_pids(rank)[-1] == ns_pids(children(pid)[0])[-1]
    size = log.stat().st_size
    wait_until(lambda: log.stat().st_size > size, timeout=30)


@needs_root
def test_corrupt_newest_falls_back(criu_info: CriuInfo, work: Path, jobs: list[int]) -> None:
    """Flipped bytes in the newest image: it is refused, the previous one restores, and why."""
    script = _script(work, "count.py", COUNTER)
    n = 150
    release = work / "release"
    job = _launch(work, "corrupt", [SYSTEM_PYTHON, script, str(n), str(release)], jobs)
    pid, log = job.pid, job.log()
    assert wait_for_line(log, "3\n", 30)
    cp = _checkpointer(criu_info, work / "store", keep=5)

    async def two() -> None:
        await cp.checkpoint("c", pid, owner_uid=0, owner_gid=0, leave_running=True, rewind_paths=[str(log)])
        await asyncio.sleep(0.3)
        await cp.checkpoint("c", pid, owner_uid=0, owner_gid=0, leave_running=True, rewind_paths=[str(log)])

    run(two())
    kill_tree(pid)
    store = cp.store
    pages = sorted(
        (store.checkpoint_dir("c", 2) / "images").glob("pages-*.img"), key=lambda p: p.stat().st_size
    )[-1]
    with open(pages, "r+b") as f:
        f.seek(pages.stat().st_size // 2)
        b = f.read(4)
        f.seek(-4, os.SEEK_CUR)
        f.write(bytes(x ^ 0xFF for x in b))
    (store.checkpoint_dir("c", 3)).mkdir()
    manifest, choice = store.latest_valid("c")
    assert manifest is not None and manifest.seq == 1
    assert [s.seq for s in choice.skipped] == [3, 2]
    rr = run(cp.restore_latest("c"))
    assert rr.seq == 1
    reasons = {s.seq: s.reason for s in rr.skipped}
    assert "no manifest" in reasons[3]
    assert f"{pages.relative_to(store.checkpoint_dir('c', 2))} fails its sha256 check" in reasons[2]
    _track(jobs, rr.pid)
    release.touch()
    _finish(rr.pid, job)
    assert log.read_text() == "".join(f"{i}\n" for i in range(n)) + "done\n"
    with pytest.raises(NoValidCheckpoint):
        run(cp.restore_latest("nothing-here"))


@needs_root
def test_images_readable_by_owner_only(criu_info: CriuInfo, work: Path, jobs: list[int]) -> None:
    """A checkpoint directory is the job user's, mode 0700; another user can read nothing."""
    owner, other = ensure_user(TEST_USER), ensure_user(OTHER_USER)
    script = _script(work, "count.py", COUNTER)
    release = work / "release"
    job = _launch(work, "perm", [SYSTEM_PYTHON, script, "100000", str(release)], jobs)
    pid, log = job.pid, job.log()
    assert wait_for_line(log, "2\n", 30)
    cp = _checkpointer(criu_info, work / "store")
    r = run(cp.checkpoint("perm", pid, owner_uid=owner.pw_uid, owner_gid=owner.pw_gid, leave_running=True))
    d = r.path
    st = d.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (owner.pw_uid, owner.pw_gid, 0o700)
    manifest = d / "manifest.json"
    for argv in (["ls", str(d)], ["cat", str(manifest)], ["ls", str(d / "images")]):
        res = _as_user(other, *argv)
        assert res.returncode != 0 and "Permission denied" in res.stderr, (argv, res)
    assert _as_user(owner, "ls", str(d)).returncode == 0
    assert _as_user(owner, "cat", str(manifest)).returncode == 0
    res = _as_user(owner, "sh", "-c", f"cp {manifest} {d}/m && mv -f {d}/m {manifest}")
    assert res.returncode == 0, res.stderr
    v = cp.store.verify("perm", r.seq)
    assert not v.ok and "owned by uid" in v.reason


@needs_root
def test_full_disk(criu_info: CriuInfo, work: Path, jobs: list[int]) -> None:
    """A dump onto a full disk fails clearly; the job runs on; the previous checkpoint is intact."""
    with small_tmpfs(work / "small", "40m") as mnt:
        script = _script(work, "count.py", COUNTER)
        release = work / "release"
        job = _launch(work, "full", [SYSTEM_PYTHON, script, "100000", str(release)], jobs)
        pid, log = job.pid, job.log()
        assert wait_for_line(log, "2\n", 30)
        cp = _checkpointer(criu_info, mnt / "store")
        first = run(cp.checkpoint("full", pid, owner_uid=0, owner_gid=0, leave_running=True))
        size = first.image_bytes
        free = shutil.disk_usage(mnt).free
        with open(mnt / "filler", "wb") as f:
            f.write(b"\1" * (free - size // 3))
        with pytest.raises(CheckpointError, match="space") as exc:
            run(cp.checkpoint("full", pid, owner_uid=0, owner_gid=0, leave_running=False))
        assert "\n" not in str(exc.value)
        assert cp.store.seqs("full") == [1]
        (mnt / "filler").unlink()
        with open(mnt / "filler", "wb") as f:
            f.write(b"\1" * (shutil.disk_usage(mnt).free - 3 * 2**20))
        images = mnt / "raw"
        images.mkdir()
        with pytest.raises(CriuError, match="no space left") as cexc:
            run(Criu(criu_info).dump(pid, images, log_file=work / "raw-dump.log", leave_running=False))
        assert cexc.value.log_path == work / "raw-dump.log"
        before = log.stat().st_size
        wait_until(lambda: log.stat().st_size > before, timeout=30)
        assert pid_alive(pid)
        assert cp.store.verify("full", 1).ok


@needs_root
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
        script = _script(work, "client.py", UNIX_CLIENT)
        release = work / "release"
        job = _launch(work, "ux", [SYSTEM_PYTHON, script, path, "150", str(release)], jobs)
        pid, log = job.pid, job.log()
        assert wait_for_line(log, "5\n", 30)
        (rank,) = children(pid)
        (inode,) = socket_inodes(rank)
        cp = _checkpointer(criu_info, work / "store")
        with pytest.raises(CheckpointError, match="external"):
            run(Criu(criu_info).dump(pid, _mk(work / "no-ext"), log_file=work / "x.log", leave_running=True))
        assert pid_alive(pid)
        r = run(
            cp.checkpoint(
                "ux", pid, owner_uid=0, owner_gid=0, leave_running=False, external_unix_inodes=[inode]
            )
        )
        assert r.manifest.external_unix_inodes == (inode,)
        fresh = socket.socket(socket.AF_UNIX)
        fresh.connect(path)

        def fds(m: Manifest) -> dict[str, int]:
            return {f"socket:[{i}]": fresh.fileno() for i in m.external_unix_inodes}

        rr = run(cp.restore_latest("ux", inherit_fds=fds))
        fresh.close()
        _track(jobs, rr.pid)
        release.touch()
        _finish(rr.pid, job)
        assert log.read_text() == "".join(f"{i}\n" for i in range(150)) + "done\n"
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


@needs_root
def test_ranks_of_another_user(criu_info: CriuInfo, work: Path, jobs: list[int]) -> None:
    """Ranks that dropped to the job's user: dumped where CRIU can, else a clear reason."""
    user = ensure_user(TEST_USER)
    script = _script(work, "count.py", COUNTER)
    release = work / "release"
    job = _launch(work, "user", [SYSTEM_PYTHON, script, "120", str(release)], jobs, user=user)
    pid, log = job.pid, job.log()
    assert wait_for_line(log, "2\n", 30)
    cp = _checkpointer(criu_info, work / "store")
    caps = int(
        next(
            line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("CapEff:")
        ).split()[1],
        16,
    )
    if not caps >> 24 & 1:
        with pytest.raises(CheckpointError, match="CAP_SYS_RESOURCE"):
            run(cp.checkpoint("user", pid, owner_uid=user.pw_uid, owner_gid=user.pw_gid, leave_running=False))
        assert pid_alive(pid) and cp.store.seqs("user") == []
        return
    run(cp.checkpoint("user", pid, owner_uid=user.pw_uid, owner_gid=user.pw_gid, leave_running=False))
    rr = run(cp.restore_latest("user"))
    _track(jobs, rr.pid)
    release.touch()
    _finish(rr.pid, job)
    assert log.read_text() == "".join(f"{i}\n" for i in range(120)) + "done\n"


@needs_root
def test_pre_copy(criu_info: CriuInfo, work: Path, jobs: list[int]) -> None:
    """With dirty tracking, pre-dumps then a short final dump; without, a clear reason."""
    script = _script(work, "count.py", COUNTER)
    release = work / "release"
    job = _launch(work, "pre", [SYSTEM_PYTHON, script, "150", str(release)], jobs)
    pid, log = job.pid, job.log()
    assert wait_for_line(log, "2\n", 30)
    cp = _checkpointer(criu_info, work / "store")
    if not criu_info.dirty_tracking:
        with pytest.raises(CheckpointUnavailable, match="dirty tracking"):
            run(Criu(criu_info).pre_dump(pid, work, log_file=work / "p.log"))
        r = run(cp.checkpoint("pre", pid, owner_uid=0, owner_gid=0, leave_running=True, pre_copy=2))
        assert "dirty tracking" in r.pre_copy_skipped
        assert r.pre_dumps == ()
        assert pid_alive(pid)
        return
    r = run(cp.checkpoint("pre", pid, owner_uid=0, owner_gid=0, leave_running=False, pre_copy=2))
    assert len(r.pre_dumps) == 2 and r.manifest.pre_dumps == ("pre-1", "pre-2")
    assert r.dump.pages_skipped_parent > 0
    rr = run(cp.restore_latest("pre"))
    _track(jobs, rr.pid)
    release.touch()
    _finish(rr.pid, job)
    assert log.read_text() == "".join(f"{i}\n" for i in range(150)) + "done\n"


@needs_root
def test_usage_prune_and_busy_lock(criu_info: CriuInfo, work: Path, jobs: list[int]) -> None:
    """Keep the last K, report disk usage, refuse a second concurrent operation on a job."""
    script = _script(work, "count.py", COUNTER)
    release = work / "release"
    job = _launch(work, "keep", [SYSTEM_PYTHON, script, "100000", str(release)], jobs)
    pid, log = job.pid, job.log()
    assert wait_for_line(log, "2\n", 30)
    cp = _checkpointer(criu_info, work / "store", keep=2)

    async def four() -> list[tuple[int, ...]]:
        out = []
        for _ in range(4):
            r = await cp.checkpoint("k", pid, owner_uid=0, owner_gid=0, leave_running=True)
            out.append(r.pruned)
        return out

    pruned = run(four())
    assert pruned == [(), (), (1,), (2,)]
    assert cp.store.seqs("k") == [3, 4]
    usage = cp.store.usage("k")
    assert usage.checkpoints == 2 and usage.bytes_on_disk > 0
    with cp.store.locked("k"), pytest.raises(CheckpointError, match="in progress"):
        run(cp.checkpoint("k", pid, owner_uid=0, owner_gid=0, leave_running=True))
    assert pid_alive(pid)
    with pytest.raises(CheckpointError, match="bad job id"):
        cp.store.job_dir("../etc")

    async def cancelled_midway() -> None:
        task = asyncio.create_task(cp.checkpoint("k2", pid, owner_uid=0, owner_gid=0, leave_running=True))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(cancelled_midway())
    assert cp.store.seqs("k2") == [1] and cp.store.verify("k2", 1).ok
    assert pid_alive(pid)


@needs_root
def test_restore_retries_while_pid_is_taken(criu_info: CriuInfo, work: Path) -> None:
    """Without a PID namespace the old PID must be free: restore retries until it is reaped."""
    script = _script(work, "count.py", COUNTER)
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
        cp = _checkpointer(criu_info, work / "store")
        run(cp.checkpoint("z", proc.pid, owner_uid=0, owner_gid=0, leave_running=False))
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
        rr = run(cp.restore_latest("z"))
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
