"""Files and FIFOs in flight in a Unix socket's queue at a dump (singularityd/checkpoint/image_files.py).

CRIU reopens such a file by its path, as root, at the restore, where no check of the restored
processes can see it: a dump whose queues carry one is refused while the tree is frozen, and the
job runs on; deleted files and memfds (whose content CRIU keeps) are no such files. The image
reader is tested on images built here; the refusal on real CRIU dumps of real processes.
"""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import pytest

from singularityd.checkpoint import CheckpointError, CriuInfo
from singularityd.checkpoint.image_files import files_in_flight, made_by_name, stopped_at_dump
from tests.checkpoint_helpers import (
    SYSTEM_PYTHON,
    checkpointer_in,
    launch_job,
    pid_alive,
    track,
    wait_exit,
    wait_for_line,
    write_script,
)
from tests.conftest import requires_root


def varint(value: int) -> bytes:
    out = b""
    while True:
        low, value = value & 0x7F, value >> 7
        out += bytes([low | (0x80 if value else 0)])
        if not value:
            return out


def number(field: int, value: int) -> bytes:
    return varint(field << 3) + varint(value)


def nested(field: int, body: bytes) -> bytes:
    return varint(field << 3 | 2) + varint(len(body)) + body


def image(*messages: bytes, trailing: bytes = b"") -> bytes:
    """A CRIU image: two magic words, then each message with its size (and `trailing` after it)."""
    return b"\x19\x43\x56\x54" * 2 + b"".join(struct.pack("<I", len(m)) + m + trailing for m in messages)


def regular_file(file_id: int, path: str) -> bytes:
    return number(1, 1) + number(2, file_id) + nested(3, number(1, file_id) + nested(6, path.encode()))


def packet_with_rights(*ids: int, packed: bool = False) -> bytes:
    rights = nested(2, b"".join(varint(i) for i in ids)) if packed else b"".join(number(2, i) for i in ids)
    return number(1, 35) + number(2, 1) + nested(4, number(1, 1) + rights)


def test_a_linked_file_in_a_queue_is_found_and_nothing_else(tmp_path: Path) -> None:
    files = [
        regular_file(36, "/home/a/data"),
        regular_file(37, "/dev/shm/gone"),
        regular_file(38, "/home/a/kept"),
    ]
    socket_entry = number(1, 5) + number(2, 40)
    (tmp_path / "files.img").write_bytes(image(*files, socket_entry))
    assert files_in_flight(tmp_path) == []  # no queue at all
    (tmp_path / "sk-queues.img").write_bytes(image(packet_with_rights(36, 37, 40), trailing=b"x"))
    assert files_in_flight(tmp_path) == ["/home/a/data", "/dev/shm/gone"]
    (tmp_path / "remap-fpath.img").write_bytes(image(number(1, 37) + number(2, 99)))  # 37 was deleted
    assert files_in_flight(tmp_path) == ["/home/a/data"]
    (tmp_path / "sk-queues.img").write_bytes(image(packet_with_rights(38, packed=True), trailing=b"y"))
    assert files_in_flight(tmp_path) == ["/home/a/kept"]


def test_a_fifo_in_a_queue_is_found_by_the_path_it_names(tmp_path: Path) -> None:
    fifo = number(1, 3) + number(2, 36) + nested(17, number(1, 36) + number(2, 7) + number(3, 37))
    memfd = number(1, 18) + number(2, 38)
    (tmp_path / "files.img").write_bytes(image(fifo, regular_file(37, "/home/a/fifo"), memfd))
    (tmp_path / "sk-queues.img").write_bytes(image(packet_with_rights(38, 36), trailing=b"z"))
    assert files_in_flight(tmp_path) == ["/home/a/fifo"]


def unix_socket(file_id: int, name: bytes, folder: bytes = b"") -> bytes:
    body = number(1, file_id) + nested(11, name) + (nested(14, folder) if folder else b"")
    return number(1, 5) + number(2, file_id) + nested(16, body)


def test_what_criu_makes_again_by_path_is_listed(tmp_path: Path) -> None:
    """Sockets bound to a path (absolute, or relative to the folder CRIU recorded) and deleted files
    CRIU re-creates; not abstract or unbound sockets, nor a file it reopens by a kept link."""
    (tmp_path / "files.img").write_bytes(
        image(
            unix_socket(40, b"/tmp/pymp-1/listener-2\0"),
            unix_socket(41, b"rel.sock\0", b"/home/a/run"),
            unix_socket(42, b"\0abstract"),
            unix_socket(43, b""),
            regular_file(44, "/dev/shm/torch_1"),
            regular_file(45, "/home/a/linked"),
            regular_file(46, "/home/a/open"),
        )
    )
    (tmp_path / "remap-fpath.img").write_bytes(
        image(number(1, 44) + number(2, 1) + number(3, 1), number(1, 45) + number(2, 2) + number(3, 0))
    )
    assert made_by_name(tmp_path) == [
        ("a Unix socket bound to", "/tmp/pymp-1/listener-2"),
        ("a Unix socket bound to", "/home/a/run/rel.sock"),
        ("a deleted file or folder re-created beside", "/dev/shm/torch_1"),
    ]


def test_the_processes_stopped_at_the_dump_are_found_by_their_pid(tmp_path: Path) -> None:
    def core(state: int | None) -> bytes:
        return number(1, 1) + (nested(3, number(1, state) + number(2, 0)) if state is not None else b"")

    (tmp_path / "core-1.img").write_bytes(image(core(1)))  # running
    (tmp_path / "core-7.img").write_bytes(image(core(3)))  # stopped
    (tmp_path / "core-8.img").write_bytes(image(core(None)))  # a thread: no task core
    (tmp_path / "core-9.img").write_bytes(image(core(6)))  # a zombie
    assert stopped_at_dump(tmp_path) == {7}
    assert stopped_at_dump(tmp_path / "none") == set()


def test_a_damaged_image_is_an_error_not_a_pass(tmp_path: Path) -> None:
    (tmp_path / "sk-queues.img").write_bytes(image(packet_with_rights(36))[:-3])
    with pytest.raises(ValueError):
        files_in_flight(tmp_path)


SENDER = """
import array, os, socket, stat, sys, time
linked, release = sys.argv[1], sys.argv[2]
a, b = socket.socketpair()
def send(fd):
    a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    os.close(fd)
scratch = f"{release}.gone"
gone = os.open(scratch, os.O_RDWR | os.O_CREAT, 0o600)
os.write(gone, b"deleted file")
os.unlink(scratch)
memfd = os.memfd_create("bytes")
os.write(memfd, b"memfd")
sent = [gone, memfd]
if linked != "-":
    os.mkfifo(linked + ".fifo")
    fifo = os.open(linked + ".fifo", os.O_RDWR)
    os.write(fifo, b"fifo")
    sent += [os.open(linked, os.O_RDONLY), fifo]
for fd in sent:
    send(fd)
print("sent", flush=True)
while not os.path.exists(release):
    time.sleep(0.05)
for _ in sent:
    _, ancillary, _, _ = b.recvmsg(1, socket.CMSG_LEN(4))
    fd = array.array("i", ancillary[0][2][:4])[0]
    if not stat.S_ISFIFO(os.fstat(fd).st_mode):
        os.lseek(fd, 0, 0)
    print(os.read(fd, 100).decode(), flush=True)
print("done", flush=True)
"""


@requires_root
def test_a_dump_with_a_file_by_path_in_flight_is_refused_and_the_job_runs_on(
    criu_info: CriuInfo, work: Path, jobs: list[int]
) -> None:
    linked = work / "data"
    linked.write_text("linked file")
    script = write_script(work, "sender.py", SENDER)
    job = launch_job(work, "sender", [SYSTEM_PYTHON, script, str(linked), str(work / "release")], jobs)
    assert wait_for_line(job.log(), "sent", 30)
    cp = checkpointer_in(criu_info, work / "store")
    refused = f"sent {linked}, {linked}.fifo over a Unix socket and none has received it"
    with pytest.raises(CheckpointError, match=refused):
        asyncio.run(cp.checkpoint("sender", job.pid, owner_uid=0, owner_gid=0, leave_running=False))
    assert pid_alive(job.pid) and cp.store.seqs("sender") == []
    (work / "release").touch()
    assert wait_for_line(job.log(), "done", 30)
    assert job.log().read_text().splitlines()[-5:] == ["deleted file", "memfd", "linked file", "fifo", "done"]


@requires_root
def test_deleted_files_and_memfds_in_flight_are_dumped_and_restored(
    criu_info: CriuInfo, work: Path, jobs: list[int]
) -> None:
    script = write_script(work, "sender.py", SENDER)
    job = launch_job(work, "sender", [SYSTEM_PYTHON, script, "-", str(work / "release")], jobs)
    assert wait_for_line(job.log(), "sent", 30)
    cp = checkpointer_in(criu_info, work / "store")
    asyncio.run(cp.checkpoint("sender", job.pid, owner_uid=0, owner_gid=0, leave_running=False))
    assert wait_exit(job.pid, 10)
    restored = track(jobs, asyncio.run(cp.restore_latest("sender")).pid)
    (work / "release").touch()
    assert wait_for_line(job.log(), "done", 30), job.log().read_text()
    assert job.log().read_text().splitlines()[-3:] == ["deleted file", "memfd", "done"]
    assert wait_exit(restored, 30)
