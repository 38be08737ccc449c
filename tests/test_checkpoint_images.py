"""Checkpoint images under real CRIU: a corrupt newest checkpoint is refused for the one before, a
checkpoint is readable by its job's user alone, a full disk fails a dump clearly and keeps the
previous one, the newest K are kept, and a job has one checkpoint operation at a time.
"""

from __future__ import annotations

import asyncio
import pwd
import shutil
import subprocess
from pathlib import Path

import pytest

from singularityd.checkpoint import CheckpointError, Criu, CriuError, CriuInfo, NoValidCheckpoint
from singularityd.checkpoint.hashing import hash_files
from tests.checkpoint_helpers import (
    SYSTEM_PYTHON,
    TEST_USER,
    checkpointer_in,
    counting_job,
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
from tests.helpers import ensure_user, invert_bytes, wait_until

OTHER_USER = "sing-test-other"
BALLAST = """
import hashlib, os, sys, time
ballast = bytearray(os.urandom(160 << 20))
print("ready", hashlib.sha256(ballast).hexdigest(), flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
print("after", hashlib.sha256(ballast).hexdigest(), flush=True)
"""


def _as_user(user: pwd.struct_passwd, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run `argv` as `user` (no other groups); what it printed and its exit status."""
    return subprocess.run(
        ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", *argv],
        capture_output=True,
        text=True,
        check=False,
    )


@requires_root
def test_corrupt_newest_falls_back(criu_info: CriuInfo, work: Path, jobs: list[int]) -> None:
    """Flipped bytes in the newest image: it is refused, the previous one restores, and why."""
    n = 150
    release = work / "release"
    job = counting_job(work, "corrupt", jobs, n, shown="3\n")
    pid, log = job.pid, job.log()
    cp = checkpointer_in(criu_info, work / "store", keep=5)

    async def two() -> None:
        await cp.checkpoint("c", pid, owner_uid=0, owner_gid=0, leave_running=True, rewind_paths=[str(log)])
        await asyncio.sleep(0.3)
        await cp.checkpoint("c", pid, owner_uid=0, owner_gid=0, leave_running=True, rewind_paths=[str(log)])

    asyncio.run(two())
    kill_tree(pid)
    store = cp.store
    pages = sorted(
        (store.checkpoint_dir("c", 2) / "images").glob("pages-*.img"), key=lambda p: p.stat().st_size
    )[-1]
    invert_bytes(pages, pages.stat().st_size // 2, 4)
    (store.checkpoint_dir("c", 3)).mkdir()
    manifest, choice = store.latest_valid("c")
    assert manifest is not None and manifest.seq == 1
    assert [s.seq for s in choice.skipped] == [3, 2]
    rr = asyncio.run(cp.restore_latest("c"))
    assert rr.seq == 1
    reasons = {s.seq: s.reason for s in rr.skipped}
    assert "no manifest" in reasons[3]
    assert f"{pages.relative_to(store.checkpoint_dir('c', 2))} fails its sha256 check" in reasons[2]
    finish_counting(rr.pid, job, jobs, release, n)
    with pytest.raises(NoValidCheckpoint):
        asyncio.run(cp.restore_latest("nothing-here"))


@requires_root
def test_a_stopping_dump_hashes_its_pages_while_criu_writes_them(
    criu_info: CriuInfo, work: Path, jobs: list[int]
) -> None:
    """A dump that stops a job with 160 MiB of memory: its pages images are hashed while CRIU
    writes them, and every digest in the manifest is that of the whole file; it restores whole."""
    release = work / "release"
    script = write_script(work, "ballast.py", BALLAST)
    job = launch_job(work, "ballast", [SYSTEM_PYTHON, script, str(release)], jobs)
    assert wait_for_line(job.log(), "ready", 60)
    cp = checkpointer_in(criu_info, work / "store")
    r = asyncio.run(cp.checkpoint("b", job.pid, owner_uid=0, owner_gid=0, leave_running=False))
    assert r.manifest.stats["hashed_while_dumped"] > 0
    folder = cp.store.checkpoint_dir("b", r.seq)
    rels = sorted(r.manifest.files)
    assert any(rel.startswith("images/pages-") for rel in rels)
    assert {rel: (rec.size, rec.sha256) for rel, rec in r.manifest.files.items()} == hash_files(folder, rels)
    rr = asyncio.run(cp.restore_latest("b"))
    track(jobs, rr.pid)
    release.touch()
    finish_job(rr.pid, job)
    ready, after = job.log().read_text().splitlines()
    assert after.split()[1] == ready.split()[1]


@requires_root
def test_images_readable_by_owner_only(criu_info: CriuInfo, work: Path, jobs: list[int]) -> None:
    """A checkpoint directory is the job user's, mode 0700; another user can read nothing."""
    owner, other = ensure_user(TEST_USER), ensure_user(OTHER_USER)
    job = counting_job(work, "perm", jobs)
    pid = job.pid
    cp = checkpointer_in(criu_info, work / "store")
    r = asyncio.run(
        cp.checkpoint("perm", pid, owner_uid=owner.pw_uid, owner_gid=owner.pw_gid, leave_running=True)
    )
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


@requires_root
def test_full_disk(criu_info: CriuInfo, work: Path, jobs: list[int]) -> None:
    """A dump onto a full disk fails clearly; the job runs on; the previous checkpoint is intact."""
    with small_tmpfs(work / "small", "40m") as mnt:
        job = counting_job(work, "full", jobs)
        pid, log = job.pid, job.log()
        cp = checkpointer_in(criu_info, mnt / "store")
        first = asyncio.run(cp.checkpoint("full", pid, owner_uid=0, owner_gid=0, leave_running=True))
        size = first.image_bytes
        free = shutil.disk_usage(mnt).free
        with open(mnt / "filler", "wb") as f:
            f.write(b"\1" * (free - size // 3))
        with pytest.raises(CheckpointError, match="space") as exc:
            asyncio.run(cp.checkpoint("full", pid, owner_uid=0, owner_gid=0, leave_running=False))
        assert "\n" not in str(exc.value)
        assert cp.store.seqs("full") == [1]
        (mnt / "filler").unlink()
        with open(mnt / "filler", "wb") as f:
            f.write(b"\1" * (shutil.disk_usage(mnt).free - 3 * 2**20))
        images = mnt / "raw"
        images.mkdir()
        with pytest.raises(CriuError, match="no space left") as cexc:
            asyncio.run(
                Criu(criu_info).dump(pid, images, log_file=work / "raw-dump.log", leave_running=False)
            )
        assert cexc.value.log_path == work / "raw-dump.log"
        before = log.stat().st_size
        wait_until(lambda: log.stat().st_size > before, timeout=30)
        assert pid_alive(pid)
        assert cp.store.verify("full", 1).ok


@requires_root
def test_usage_prune_and_busy_lock(criu_info: CriuInfo, work: Path, jobs: list[int]) -> None:
    """Keep the last K, report disk usage, refuse a second concurrent operation on a job."""
    job = counting_job(work, "keep", jobs)
    pid = job.pid
    cp = checkpointer_in(criu_info, work / "store", keep=2)

    async def four() -> list[tuple[int, ...]]:
        out = []
        for _ in range(4):
            r = await cp.checkpoint("k", pid, owner_uid=0, owner_gid=0, leave_running=True)
            out.append(r.pruned)
        return out

    pruned = asyncio.run(four())
    assert pruned == [(), (), (1,), (2,)]
    assert cp.store.seqs("k") == [3, 4]
    logs = cp.store.logs_dir("k")
    assert sorted(p.name for p in logs.glob("*dump-*")) == ["dump-00000003.log", "dump-00000004.log"]
    usage = cp.store.usage("k")
    assert usage.checkpoints == 2 and usage.bytes_on_disk > 0
    with cp.store.locked("k"), pytest.raises(CheckpointError, match="in progress"):
        asyncio.run(cp.checkpoint("k", pid, owner_uid=0, owner_gid=0, leave_running=True))
    assert pid_alive(pid)
    with pytest.raises(CheckpointError, match="bad job id"):
        cp.store.job_dir("../etc")

    async def cancelled_midway() -> None:
        task = asyncio.create_task(cp.checkpoint("k2", pid, owner_uid=0, owner_gid=0, leave_running=True))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled_midway())
    assert cp.store.seqs("k2") == [1] and cp.store.verify("k2", 1).ok
    assert pid_alive(pid)
