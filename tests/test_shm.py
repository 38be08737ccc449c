"""A job's /dev/shm files carried in its checkpoints: which are found, and how they are put back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from singularityd.checkpoint import shm
from singularityd.checkpoint.dump_script import post_dump_script
from singularityd.checkpoint.shm import (
    SHM,
    SHM_IMAGES,
    SHM_INDEX,
    SharedFile,
    SharedMemoryError,
    copy_path,
    prepare_copies,
    release,
    shared_memory_files,
    write_back,
)
from tests.conftest import requires_root

NOBODY = 65534

HOLDER = """
import mmap, os, sys
linked, deleted, opened = sys.argv[1:4]
maps = []
for path in (linked, deleted):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4096)
    maps.append(mmap.mmap(fd, 4096))
    os.close(fd)
os.unlink(deleted)
held = os.open(opened, os.O_RDWR | os.O_CREAT, 0o600)
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def names() -> Iterator[list[str]]:
    """Fresh names in /dev/shm, removed afterwards."""
    made = [f"sing-test-{uuid.uuid4().hex[:12]}-{i}" for i in range(3)]
    yield made
    for name in made:
        (SHM / name).unlink(missing_ok=True)


def test_the_linked_files_a_process_maps_or_holds_open_are_found(names: list[str]) -> None:
    """A mapped file and an open one are the job's (owned by its user); a mapping of a deleted file
    is not (CRIU carries that one itself), nor are files of another owner."""
    linked, deleted, opened = (str(SHM / name) for name in names)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, linked, deleted, opened],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        found = shared_memory_files([holder.pid], os.getuid())
        assert [f.name for f in found] == sorted([names[0], names[2]])
        assert all(f.uid == os.getuid() and f.mode == 0o600 for f in found)
        assert shared_memory_files([holder.pid], os.getuid() + 1) == []
    finally:
        holder.kill()
        holder.wait()


def _saved(images: Path, files: list[SharedFile], contents: list[bytes]) -> None:
    """A checkpoint's images holding copies of `files` with `contents`."""
    prepare_copies(images, files)
    for each, data in zip(files, contents, strict=True):
        copy_path(images, each.name).write_bytes(data)


@requires_root
def test_written_back_as_their_owners_with_the_saved_bytes(tmp_path: Path, names: list[str]) -> None:
    """A file gone from /dev/shm is made again, its owner's, with its mode and bytes; one still
    there (the job's bytes since the checkpoint) gets the checkpoint's bytes and size back."""
    files = [SharedFile(names[0], NOBODY, NOBODY, 0o640), SharedFile(names[1], NOBODY, NOBODY, 0o600)]
    _saved(tmp_path, files, [b"semaphore", b"block" * 100])
    there = SHM / names[1]
    there.write_bytes(b"written since" * 1000)
    os.chown(there, NOBODY, NOBODY)
    assert sorted(write_back(tmp_path)) == sorted(names[:2])
    for each, data in zip(files, [b"semaphore", b"block" * 100], strict=True):
        path = SHM / each.name
        facts = path.stat()
        assert (facts.st_uid, facts.st_gid, facts.st_mode & 0o777) == (NOBODY, NOBODY, each.mode)
        assert path.read_bytes() == data


def test_a_file_larger_than_a_chunk_is_written_back_whole(
    tmp_path: Path, names: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write-back moves a file in chunks (a shared block may be as large as the job's memory):
    every chunk lands at its place, the last one short."""
    monkeypatch.setattr(shm, "COPY_CHUNK_BYTES", 4096)
    data = os.urandom(5 * 4096 + 123)
    files = [SharedFile(names[0], os.getuid(), os.getgid(), 0o600)]
    _saved(tmp_path, files, [data])
    assert write_back(tmp_path) == [names[0]]
    assert (SHM / names[0]).read_bytes() == data


@requires_root
def test_never_written_into_another_users_file_nor_through_a_link(tmp_path: Path, names: list[str]) -> None:
    """The daemon writes as root into a directory every user writes to: a name another user took,
    or a link planted there, stops the restore with a clear message and changes nothing."""
    _saved(tmp_path, [SharedFile(names[0], NOBODY, NOBODY, 0o600)], [b"saved"])
    theirs = SHM / names[0]
    theirs.write_bytes(b"another user's")
    with pytest.raises(SharedMemoryError, match="another user's file has its name"):
        write_back(tmp_path)
    assert theirs.read_bytes() == b"another user's"
    theirs.unlink()
    target = tmp_path / "target"
    target.write_bytes(b"untouched")
    theirs.symlink_to(target)
    with pytest.raises(SharedMemoryError, match="cannot put"):
        write_back(tmp_path)
    assert target.read_bytes() == b"untouched"


def test_a_fifo_in_place_of_a_file_stops_the_restore_at_once(tmp_path: Path, names: list[str]) -> None:
    """A FIFO the job's user made under a saved file's name, with or without a reader: the write-back
    refuses it at once (its open waited for a reader for ever, holding the restore and the job's
    devices), and never writes into it."""
    _saved(tmp_path, [SharedFile(names[0], os.getuid(), os.getgid(), 0o600)], [b"saved"])
    fifo = SHM / names[0]
    os.mkfifo(fifo, 0o666)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(SharedMemoryError, match="something other than a regular file has its name"):
            write_back(tmp_path)
        assert os.read(reader, 100) == b""
    finally:
        os.close(reader)
    with pytest.raises(SharedMemoryError, match="cannot put"):
        write_back(tmp_path)  # no reader: the open fails at once


def test_a_name_outside_dev_shm_is_refused(tmp_path: Path) -> None:
    """A checkpoint's list naming a path outside /dev/shm is refused, whatever wrote it."""
    folder = tmp_path / SHM_IMAGES
    folder.mkdir()
    (folder / SHM_INDEX).write_text(json.dumps([{"name": "../x", "uid": 0, "gid": 0, "mode": 384}]))
    with pytest.raises(SharedMemoryError, match="outside /dev/shm"):
        write_back(tmp_path)
    (folder / SHM_INDEX).write_text("{not json")
    with pytest.raises(SharedMemoryError, match="unreadable"):
        write_back(tmp_path)


def _run_script(tmp_path: Path, copies: list[str]) -> int:
    """Run a final dump's action script with these copy lines, as CRIU runs it after the dump."""
    script = tmp_path / "post-dump.sh"
    script.write_text(
        post_dump_script(
            [], tmp_path / "sizes", None, copies, images=tmp_path, in_flight_out=tmp_path / "out"
        )
    )
    env = {**os.environ, "CRTOOLS_SCRIPT_ACTION": "post-dump"}
    return subprocess.run(["sh", str(script)], env=env, check=False).returncode


def test_the_action_script_copies_skips_what_went_and_fails_on_a_failed_copy(
    tmp_path: Path, names: list[str]
) -> None:
    """The copies are made while the tree is frozen; a file removed since it was found is skipped,
    and a copy that fails leaves nothing behind and fails the script (CRIU then lets the job run
    on: the checkpoint fails rather than keep half a file)."""
    (SHM / names[0]).write_bytes(b"semaphore")
    images = tmp_path / "images"
    images.mkdir()
    files = [SharedFile(name, os.getuid(), os.getgid(), 0o600) for name in names[:2]]
    assert _run_script(tmp_path, prepare_copies(images, files)) == 0
    assert copy_path(images, names[0]).read_bytes() == b"semaphore"
    assert not copy_path(images, names[1]).exists()  # never there: skipped
    copies = prepare_copies(images, files)
    copies_folder = copy_path(images, names[0]).parent
    for entry in copies_folder.iterdir():
        entry.unlink()
    copies_folder.rmdir()  # the copy now fails
    assert _run_script(tmp_path, copies) != 0
    assert not copies_folder.exists()


@requires_root
def test_released_where_they_are_still_their_owners_files(tmp_path: Path, names: list[str]) -> None:
    """A job that ended with no processes to remove its files: those its checkpoints carried go,
    where they are still their owner's regular files; another user's file of the name stays."""
    files = [SharedFile(name, NOBODY, NOBODY, 0o600) for name in names]
    _saved(tmp_path, files, [b"a", b"b", b"c"])
    for name, owner in zip(names, [NOBODY, 0, NOBODY], strict=True):
        (SHM / name).write_bytes(b"there")
        os.chown(SHM / name, owner, owner)
    (SHM / names[2]).unlink()
    assert release([tmp_path]) == [names[0]]
    assert not (SHM / names[0]).exists() and (SHM / names[1]).read_bytes() == b"there"


@requires_root
def test_a_name_swapped_for_a_link_copies_only_what_its_owner_reads(tmp_path: Path, names: list[str]) -> None:
    """The copies are made by root while the tree is frozen: a user who swaps the name for a link
    to a file only root may read (between the listing and the dump) must get no copy of it, which a
    restore would write back as theirs. Links are not followed and a file that is no longer the
    user's is not copied: the checkpoint fails instead."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"root only")
    secret.chmod(0o600)
    images = tmp_path / "images"
    images.mkdir()
    copies = prepare_copies(images, [SharedFile(names[0], NOBODY, NOBODY, 0o600)])
    (SHM / names[0]).symlink_to(secret)
    assert _run_script(tmp_path, copies) != 0
    assert not copy_path(images, names[0]).exists()
    (SHM / names[0]).unlink()
    (SHM / names[0]).write_bytes(b"root's now")  # another owner's file under the name
    assert _run_script(tmp_path, copies) != 0
    assert not copy_path(images, names[0]).exists()
