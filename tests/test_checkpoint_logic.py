"""The checkpoint layer's decisions and bookkeeping, without CRIU: manifests and their checks,
which checkpoint to restore and which to prune, CRIU's version, log and privilege findings, what
keeps a process tree from being dumped, hashing images in two goes, a dump's intent surviving a
killed daemon, and the sizes a post-dump script records.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import cast

import pytest

from singularityd.checkpoint import (
    CheckpointUnavailable,
    FileRecord,
    ImageStore,
    Manifest,
    NoValidCheckpoint,
    Verdict,
    locate_criu,
)
from singularityd.checkpoint import store as store_module
from singularityd.checkpoint.criu import Criu, parse_stats
from singularityd.checkpoint.criu_discovery import parse_version, privilege_problem, tcp_problem
from singularityd.checkpoint.criu_log import summarize_log
from singularityd.checkpoint.dump_script import (
    FAILED_LOGS_KEPT,
    TCP_REFUSED_EXIT,
    keep_failed_log,
    parse_sizes,
    post_dump_script,
)
from singularityd.checkpoint.hashing import (
    GrowingFileHasher,
    hash_file,
    hash_files,
    hash_open_files,
    hash_prefixes,
    open_for_hashing,
)
from singularityd.checkpoint.manifest import (
    FileFact,
    FileKind,
    ManifestError,
    Skipped,
    choose_latest,
    digest_problems,
    plan_prune,
    structural_problems,
)
from singularityd.checkpoint.precheck import DaemonFacts, ProcFacts, tree_problems
from singularityd.checkpoint.restoring import Restorer
from singularityd.checkpoint.staging import staged_folder
from tests.conftest import requires_root


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


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("dir", "is a directory"),
        ("symlink", "is a symbolic link"),
        ("other", "is a special file (a device, socket or pipe)"),
    ],
)
def test_structural_problems_name_a_wrong_kind_of_file_in_plain_words(kind: FileKind, words: str) -> None:
    m = _manifest(core=10, pages=90)
    facts = {
        "images/core.img": FileFact(kind, 0, 0, "x" if kind == "symlink" else None),
        "images/pages.img": FileFact("file", 0, 90),
        "images/parent": FileFact("symlink", 0, 0, "../pre-1"),
        "images": FileFact("dir", 0),
    }
    problems = structural_problems(m, facts, expected_job="j1", expected_seq=2, trusted_uid=0)
    assert problems == [f"images/core.img {words}, not a regular file"]


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
    assert [(s.seq, s.reason) for s in choice.skipped] == [(4, "incomplete"), (3, "a; b; c; and 1 more")]
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
        "(for torch.distributed set USE_LIBUV=0 so its TCPStore and RPC do not use libuv, "
        "and name no 'uv' transport or 'mpt_uv' channel in TensorPipeRpcBackendOptions)"
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


def test_files_hashed_while_another_writer_appends_hash_as_a_whole(tmp_path: Path) -> None:
    """Pages images hashed while CRIU appends to them, the rest at the manifest: the same sha256
    as hashing each whole file after; a file replaced meanwhile and other files are left out."""
    images = tmp_path / "images"
    images.mkdir()
    grown, replaced, other = images / "pages-1.img", images / "pages-2.img", images / "pagemap-1.img"
    other.write_bytes(b"not followed")
    done = threading.Event()

    def append() -> None:
        with grown.open("ab") as out, replaced.open("ab") as first:
            for _ in range(40):
                out.write(os.urandom(300_001))
                out.flush()
                first.write(os.urandom(4096))
                first.flush()
                time.sleep(0.005)
        replaced.unlink()
        replaced.write_bytes(os.urandom(400_000))  # longer than what was hashed of the first
        with grown.open("ab") as out:
            out.write(os.urandom(12345))
        done.set()

    with GrowingFileHasher(images, tmp_path, "pages-*.img", poll_s=0.002) as hasher:
        writer = threading.Thread(target=append)
        writer.start()
        writer.join()
    assert done.is_set()
    prefixes = hasher.prefixes()
    assert list(prefixes) == ["images/pages-1.img"]
    assert 0 < prefixes["images/pages-1.img"].size <= grown.stat().st_size
    rels = ["images/pages-1.img", "images/pages-2.img", "images/pagemap-1.img"]
    assert hash_files(tmp_path, rels, prefixes=prefixes) == hash_files(tmp_path, rels)


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


def test_a_deleted_newest_checkpoint_is_reported_and_its_number_not_reused(tmp_path: Path) -> None:
    """A newest checkpoint whose folder was deleted was passed over in silence: the job resumed from
    an older one with no word of it, and its number went to the next checkpoint."""
    store = ImageStore(tmp_path / "store", trusted_uid=os.getuid())
    uid, gid = os.getuid(), os.getgid()
    for _ in range(2):
        pending = store.begin("7", owner_uid=uid, owner_gid=gid)
        (pending.path / "images" / "core-1.img").write_bytes(b"image")
        store.finish(pending, leave_running=True, criu_version="4.2")
    assert store.vanished("7") == []
    shutil.rmtree(store.checkpoint_dir("7", 2))
    assert store.vanished("7") == [Skipped(2, "its folder is gone: deleted outside singularityd")]
    shutil.rmtree(store.checkpoint_dir("7", 1))
    with pytest.raises(NoValidCheckpoint, match="2: its folder is gone"):
        asyncio.run(Restorer(cast(Criu, None), store).restore_latest("7"))
    assert store.begin("7", owner_uid=uid, owner_gid=gid).seq == 3


@requires_root
def test_files_in_a_checkpoint_the_user_owns_are_read_only_as_the_daemon_wrote_them(tmp_path: Path) -> None:
    """A finished checkpoint's folder is its user's: a FIFO put in place of its manifest blocked
    every reader (the daemon's event loop), and markers the user wrote in place of the daemon's
    (`.staged.json`, `.intent.json`) made the daemon delete or hash folders they named. Only
    regular files the daemon (its uid) owns are read; the daemon's temporary file is never a link."""
    store = ImageStore(tmp_path / "store", trusted_uid=os.getuid())
    pending = store.begin("7", owner_uid=os.getuid(), owner_gid=os.getgid())
    (pending.path / "images" / "core-1.img").write_bytes(b"image")
    store.finish(pending, leave_running=False, criu_version="4.2")
    manifest = pending.path / "manifest.json"
    manifest.rename(pending.path / "kept.json")
    os.mkfifo(manifest)
    began = time.monotonic()
    with pytest.raises(ManifestError, match="not a regular file owned by uid"):
        store.read_manifest("7", pending.seq)
    assert time.monotonic() - began < 1
    manifest.unlink()
    victim = tmp_path / "victim"
    victim.mkdir()
    for marker, forged in (
        (".staged.json", {"staging_folder": str(victim)}),
        (".intent.json", {"owner_uid": 0}),
    ):
        (pending.path / marker).write_text(json.dumps(forged))
        os.chown(pending.path / marker, os.getuid() + 1, -1)  # another user's file
    assert store.cut_short_staged("7") is None and store.interrupted("7") is None
    assert staged_folder(pending.path, os.getuid()) is None
    target = tmp_path / "target"
    target.write_text("kept")
    (pending.path / ".intent.json.tmp").symlink_to(target)
    store.record_intent(pending, {"criu_version": "4.2"})
    assert target.read_text() == "kept" and store.interrupted("7") is not None


def test_files_hashed_as_they_arrived_are_checked_against_the_manifest_without_a_read(tmp_path: Path) -> None:
    """A move's target knows the sha256 of what it received: the restore's check compares those
    with the manifest and reads only the other files; a received file whose bytes differ from
    what the manifest says fails the checkpoint, as a re-read would."""
    store = ImageStore(tmp_path / "store")
    pending = store.begin("9", owner_uid=os.getuid(), owner_gid=os.getgid())
    pages, core = os.urandom(3 << 20), b"core"
    (pending.path / "images" / "pages-1.img").write_bytes(pages)
    (pending.path / "images" / "core-1.img").write_bytes(core)
    store.finish(pending, leave_running=False, criu_version="4.2")
    right = {"images/pages-1.img": hashlib.sha256(pages).hexdigest()}
    assert store.verify("9", pending.seq) == Verdict.good(pending.seq, len(pages) + len(core))
    assert store.verify("9", pending.seq, known=right) == Verdict.good(pending.seq, len(core))
    damaged = {"images/pages-1.img": hashlib.sha256(b"x" + pages[1:]).hexdigest()}
    verdict = store.verify("9", pending.seq, known=damaged)
    assert not verdict.ok and verdict.reason == "images/pages-1.img fails its sha256 check"

    left = store.verify("9", pending.seq, known=damaged, checked_later=["images/pages-1.img"])
    assert left == Verdict.good(pending.seq, len(core)), (
        "a file left to the caller is not read or judged here"
    )
    (pending.path / "images" / "pages-1.img").write_bytes(pages[:-1])
    shrunk = store.verify("9", pending.seq, checked_later=["images/pages-1.img"])
    assert not shrunk.ok, "a file left to the caller still has its size checked"


def test_open_files_are_hashed_after_a_rename_and_closed(tmp_path: Path) -> None:
    """A move's target opens the rebuilt images, places them (a rename), and hashes them beside
    CRIU's restore: the digests are of the files opened, and every fd is closed afterwards."""
    data = {"a.img": os.urandom(5 << 20), "b.img": b""}
    for name, content in data.items():
        (tmp_path / name).write_bytes(content)
    opened = open_for_hashing(tmp_path, list(data))
    (tmp_path / "moved").mkdir()
    for name in data:
        (tmp_path / name).rename(tmp_path / "moved" / name)
    assert hash_open_files(opened) == {
        name: hashlib.sha256(content).hexdigest() for name, content in data.items()
    }
    for fd in opened.values():
        with pytest.raises(OSError):
            os.fstat(fd)
    with pytest.raises(FileNotFoundError):
        open_for_hashing(tmp_path / "moved", ["a.img", "missing.img"])


def test_post_dump_script_records_sizes(tmp_path: Path) -> None:
    a = tmp_path / "a b.log"
    a.write_bytes(b"12345")
    out = tmp_path / "sizes"
    script = tmp_path / "s.sh"
    paths = [str(a), str(tmp_path / "missing")]
    script.write_text(post_dump_script(paths, out, images=tmp_path, in_flight_out=tmp_path / "in-flight"))
    script.chmod(0o700)
    subprocess.run([str(script)], env={"CRTOOLS_SCRIPT_ACTION": "pre-dump"}, check=True)
    assert not out.exists()
    subprocess.run([str(script)], env={"CRTOOLS_SCRIPT_ACTION": "post-dump"}, check=True)
    assert parse_sizes(paths, out.read_text()) == {str(a): 5, str(tmp_path / "missing"): -1}


def test_post_dump_script_of_a_dump_without_the_lock_fails_on_a_tcp_connection(tmp_path: Path) -> None:
    """The script of a dump taken without the network lock fails (so CRIU lets the tree run on)
    exactly when the images hold an established TCP connection, and records sizes otherwise."""
    images = tmp_path / "the images"
    images.mkdir()
    out = tmp_path / "sizes"
    script = tmp_path / "s.sh"
    script.write_text(post_dump_script([], out, images, images=images, in_flight_out=tmp_path / "in-flight"))
    script.chmod(0o700)
    post_dump = {"CRTOOLS_SCRIPT_ACTION": "post-dump"}
    assert subprocess.run([str(script)], env=post_dump).returncode == 0 and out.exists()
    (images / "inetsk.img").write_bytes(b"")
    assert subprocess.run([str(script)], env=post_dump).returncode == 0
    (images / "tcp-stream-82e3b8.img").write_bytes(b"")
    assert subprocess.run([str(script)], env={"CRTOOLS_SCRIPT_ACTION": "pre-dump"}).returncode == 0
    assert subprocess.run([str(script)], env=post_dump).returncode == TCP_REFUSED_EXIT


def test_a_failed_dumps_log_is_kept_aside_and_only_the_newest_are(tmp_path: Path) -> None:
    """The log moves out of the way of the next dump of the same number; old failures go."""
    for seq in range(1, FAILED_LOGS_KEPT + 3):
        log = tmp_path / f"dump-{seq:08d}.log"
        log.write_text(f"failure {seq}")
        kept = keep_failed_log(log)
        assert not log.exists() and kept.read_text() == f"failure {seq}"
        assert kept.name.startswith(f"dump-{seq:08d}-failed-") and kept.suffix == ".log"
        os.utime(kept, (1000.0 + seq, 1000.0 + seq))
    left = sorted(p.read_text() for p in tmp_path.glob("*-failed-*.log"))
    assert left == sorted(f"failure {seq}" for seq in range(3, FAILED_LOGS_KEPT + 3))
    assert keep_failed_log(tmp_path / "never-written.log") == tmp_path / "never-written.log"
