"""A restore never hands a job a file its user may not open (singularityd/checkpoint/reopened.py).

CRIU restores as root and reopens the files of a job's processes by path; their user can swap a
folder on such a path for a link between the checkpoint and the restore. The pure parsers are
tested alone; the probe against live processes that hold what root gave them (as CRIU would);
the whole on a real daemon, a real checkpoint and a real swap.
"""

from __future__ import annotations

import os
import pwd
import socket
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from singularityd.checkpoint.reopened import (
    HeldFile,
    Holder,
    by_path,
    fd_access,
    file_ids,
    held_files,
    link_on_the_way,
    mapped_files,
    mapping_access,
    mount_point_of,
    probe_requests,
    reopened_problems,
    watches,
)
from singularityd.units import first_few
from tests.conftest import requires_root
from tests.helpers import Daemon, other_user, python_for_user, running_daemon, wait_until

R, W, X = os.R_OK, os.W_OK, os.X_OK


def test_the_access_an_open_file_gives_follows_its_flags() -> None:
    assert fd_access(os.O_RDONLY) == R
    assert fd_access(os.O_WRONLY | os.O_APPEND) == W
    assert fd_access(os.O_RDWR | os.O_CLOEXEC) == R | W
    assert fd_access(0o10000000 | os.O_CLOEXEC) == 0  # O_PATH: the folders on the way only


def test_a_mapping_needs_writing_only_when_shared_and_writable() -> None:
    assert mapping_access("r-xp") == R
    assert mapping_access("rw-p") == R
    assert mapping_access("rw-s") == R | W
    assert mapping_access("r--s") == R
    assert mapping_access("---p") == R


def test_only_files_by_path_are_checked() -> None:
    assert by_path("/home/a/data.bin") and by_path("/dev/shm/x (deleted)")  # deleted: by link count
    assert not by_path("socket:[123]") and not by_path("pipe:[9]") and not by_path("anon_inode:[eventfd]")
    maps = textwrap.dedent(
        """\
        55d0-55d1 r--p 00000000 fd:00 260875                     /usr/bin/sleep
        7f00-7f01 rw-s 00000000 00:1a 77                         /dev/shm/torch_1 (deleted)
        7f01-7f02 rw-p 00000000 00:00 0                          [heap]
        7f02-7f03 rw-p 00000000 00:00 0
        7f03-7f04 rw-s 00000000 fd:00 12                         /data/with spaces.bin
        """
    )
    assert mapped_files(maps) == [("55d0-55d1", "r--p"), ("7f00-7f01", "rw-s"), ("7f03-7f04", "rw-s")]


def test_a_process_checks_as_its_filesystem_ids() -> None:
    status = "Name:\tpython\nUid:\t1000\t1000\t1000\t1001\nGid:\t50\t50\t50\t51\nGroups:\t7 3 \n"
    assert file_ids(status) == (1001, 51, (3, 7))
    assert file_ids("Name:\tx\n") is None


def test_one_probe_serves_the_processes_of_one_user_and_view_each_file_once() -> None:
    a = HeldFile("/d/a", R, 1, 10, "fd 3")
    b = HeldFile("/d/b", R | W, 1, 11, "fd 4")
    ranks = [
        Holder(10, 1000, 100, (100,), 7, (a, b)),
        Holder(11, 1000, 100, (100,), 7, (a,)),
        Holder(12, 1001, 100, (100,), 7, (a,)),
    ]
    requests = probe_requests(ranks)
    assert [(r["pid"], r["uid"], len(r["files"])) for r in requests] == [(10, 1000, 2), (12, 1001, 1)]  # type: ignore[arg-type]
    assert requests[0]["files"] == [["/d/a", R, 1, 10, "fd 3"], ["/d/b", R | W, 1, 11, "fd 4"]]


def test_a_summary_shows_the_first_problems_and_counts_the_rest() -> None:
    assert first_few(["a", "b"]) == "a; b"
    assert first_few(["a", "b", "c", "d", "e"]) == "a; b; c; and 2 more"
    assert first_few(["a", "b", "c", "d"], ", ") == "a, b, c, and 1 more"


HOLDER = """
import ctypes, os, sys, time
secret, folder, uid, gid = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
fd = os.open(secret, os.O_RDWR)          # what CRIU, as root, would reopen by a swapped path
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
mapped = os.open(secret, os.O_RDONLY)
assert libc.mmap(None, 4096, 1, 1, mapped, 0) != ctypes.c_void_p(-1).value   # PROT_READ, MAP_SHARED
os.close(mapped)                         # the mapping alone holds it
os.chdir(folder)                         # a working directory the user may not enter
os.setgroups([]); os.setresgid(gid, gid, gid); os.setresuid(uid, uid, uid)
print(fd, flush=True)
time.sleep(60)
"""


@pytest.fixture
def locked_room(daemon_root: Path) -> Iterator[Path]:
    """A root-only folder holding a root-only file, in a folder other users may enter."""
    room = daemon_root / "room"
    room.mkdir(mode=0o700)
    (room / "secret").write_bytes(b"S" * 4096)
    os.chmod(room / "secret", 0o600)
    yield room


def python_of(user: str) -> list[str]:
    """A Python command line `user` may run, with this project importable; skips where none is."""
    python = python_for_user(user)
    if python is None:
        pytest.skip(f"no Python with this project importable by {user} here")
    return python


def resumes_once_put_back(
    daemon: Daemon, job: int, user: str, link: Path, aside: Path, release: Path
) -> None:
    """Put the folder set aside back in place of the link: the job resumes and ends well."""
    link.unlink()
    aside.rename(link)
    again = daemon.sing("resume", "--wait", str(job), user=user, timeout=120)
    assert again.code == 0, again.err
    release.touch()
    daemon.wait_ok(job, timeout=120)


def start_holder(script: str, *args: object) -> tuple[subprocess.Popen[str], int]:
    """Run a holder script as root, with a Python another user can run; the process and the fd it
    printed once it dropped to that user."""
    python = python_of(other_user())
    holder = subprocess.Popen([*python, "-c", script, *map(str, args)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    line = holder.stdout.readline()
    if not line:
        holder.wait()
        pytest.fail(f"the holder failed (exit {holder.returncode})")
    return holder, int(line)


@requires_root
def test_files_a_process_holds_but_its_user_may_not_open_are_found(locked_room: Path) -> None:
    """A process of another user holding, by root's grace, a root-only file read-write, a mapping of
    it and a working directory it may not enter: each is named, and nothing it may hold."""
    owner = pwd.getpwnam(other_user())
    secret = locked_room / "secret"
    holder, fd = start_holder(HOLDER, secret, locked_room, owner.pw_uid, owner.pw_gid)
    try:
        held = held_files(holder.pid)
        assert held is not None and held.uid == owner.pw_uid
        problems = reopened_problems(holder.pid)
        assert f"fd {fd} {secret}: its user cannot reach it (Permission denied)" in problems, problems
        assert f"a mapped file {secret}: its user cannot reach it (Permission denied)" in problems, problems
        assert f"the working directory {locked_room}: its user may not enter it" in problems
        assert len(problems) == 3, problems
        os.chmod(locked_room, 0o711)  # now the user may reach the file, but not open it
        problems = reopened_problems(holder.pid)
        assert sorted(problems) == [
            f"a mapped file {secret}: its user may not open it for reading",
            f"fd {fd} {secret}: its user may not open it for reading and writing",
        ], problems
        os.chmod(secret, 0o644)  # readable, still not writable
        problems = reopened_problems(holder.pid)
        assert problems == [f"fd {fd} {secret}: its user may not open it for writing"], problems
        os.chown(secret, owner.pw_uid, owner.pw_gid)
        assert reopened_problems(holder.pid) == []
    finally:
        holder.kill()
        holder.wait()


@requires_root
def test_a_file_named_as_deleted_is_checked_and_one_deleted_is_not(locked_room: Path) -> None:
    """A file whose name ends in ' (deleted)', as /proc writes a deleted one's, is still reopened by
    CRIU by its path: it is checked; a file really deleted (no link left) is restored from the
    images, and is not."""
    owner = pwd.getpwnam(other_user())
    named = locked_room / "secret (deleted)"
    (locked_room / "secret").rename(named)
    holder, fd = start_holder(HOLDER, named, "/", owner.pw_uid, owner.pw_gid)
    try:
        problems = reopened_problems(holder.pid)
        assert f"fd {fd} {named}: its user cannot reach it (Permission denied)" in problems, problems
        named.unlink()
        assert reopened_problems(holder.pid) == []
    finally:
        holder.kill()
        holder.wait()


WATCHER = """
import ctypes, os, sys, time
folder, uid, gid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
assert libc.inotify_add_watch(fd, folder.encode(), 0x100) > 0   # as CRIU, root, restores it by path
os.setgroups([]); os.setresgid(gid, gid, gid); os.setresuid(uid, uid, uid)
print(fd, flush=True)
time.sleep(60)
"""


@requires_root
def test_an_inotify_watch_on_a_folder_its_user_may_not_read_is_found(locked_room: Path) -> None:
    """A watch names the files made in its folder: one on a folder the user may not read (CRIU
    restored it by a path swapped for a link) is named; one on their own folder is not."""
    owner = pwd.getpwnam(other_user())
    holder, fd = start_holder(WATCHER, locked_room, owner.pw_uid, owner.pw_gid)
    try:
        problems = reopened_problems(holder.pid)
        assert problems == [f"a watch of fd {fd} {locked_room}: its user may not open it for reading"], (
            problems
        )
        os.chown(locked_room, owner.pw_uid, owner.pw_gid)
        assert reopened_problems(holder.pid) == []
    finally:
        holder.kill()
        holder.wait()


def test_the_inodes_a_watch_descriptor_watches_are_read_from_its_fdinfo() -> None:
    info = (
        "pos:\t0\nflags:\t00\nmnt_id:\t17\nino:\t1044\n"
        "inotify wd:1 ino:3f7e8 sdev:fe00000 mask:100 ignored_mask:0 fhandle-bytes:8 fhandle-type:1 "
        "f_handle:e8f7030000000000\n"
        "fanotify ino:2a sdev:800001 mflags:0 mask:1 ignored_mask:0 fhandle-bytes:8 fhandle-type:1 "
        "f_handle:2a00000000000000\n"
        "fanotify mnt_id:20 mflags:0 mask:1 ignored_mask:0\n"
    )
    found = watches(info)
    assert [(os.major(w.dev), os.minor(w.dev), w.ino, w.handle_type) for w in found] == [
        (0xFE, 0, 0x3F7E8, 1),
        (8, 1, 0x2A, 1),
    ]
    assert found[0].handle == bytes.fromhex("e8f7030000000000")
    mountinfo = "22 1 254:0 / / rw - ext4 /dev/root rw\n30 22 8:1 / /data\\040set rw - ext4 /dev/sda1 rw\n"
    assert mount_point_of(mountinfo, os.makedev(8, 1)) == "/data set"
    assert mount_point_of(mountinfo, os.makedev(254, 0)) == "/"
    assert mount_point_of(mountinfo, os.makedev(9, 9)) is None


@requires_root
def test_a_folder_on_the_way_that_is_now_another_users_link_is_named(daemon_root: Path) -> None:
    owner = pwd.getpwnam(other_user())
    (daemon_root / "real").mkdir()
    (daemon_root / "rootlink").symlink_to(daemon_root / "real")
    (daemon_root / "userlink").symlink_to(daemon_root / "real")
    os.lchown(daemon_root / "userlink", owner.pw_uid, owner.pw_gid)
    assert link_on_the_way(str(daemon_root / "real" / "sock")) == ""
    assert link_on_the_way(str(daemon_root / "rootlink" / "sock")) == ""  # root's links stay root's
    assert link_on_the_way(str(daemon_root / "userlink")) == ""  # the last name: CRIU binds over it
    found = link_on_the_way(str(daemon_root / "userlink" / "sub" / "sock"))
    assert found == f"{daemon_root / 'userlink'} is now a link owned by uid {owner.pw_uid}"
    assert link_on_the_way("/no/such/folder/sock") == ""


SHADOWED = """
import ctypes, os, sys, time
held, other, uid, gid = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
fd = os.open(held, os.O_RDONLY)
libc = ctypes.CDLL(None, use_errno=True)
assert libc.unshare(0x00020000) == 0                                   # a mount namespace of its own
assert libc.mount(None, b"/", None, ctypes.c_ulong(0x4000 | 1 << 18), None) == 0   # private
assert libc.mount(other.encode(), held.encode(), None, ctypes.c_ulong(0x1000), None) == 0  # bind
os.setgroups([]); os.setresgid(gid, gid, gid); os.setresuid(uid, uid, uid)
print(fd, flush=True)
time.sleep(60)
"""


@requires_root
def test_a_path_that_leads_to_another_file_is_found_in_the_process_own_mounts(daemon_root: Path) -> None:
    """A file the user may open, but not the one the process holds, is no excuse; and the path is
    followed in the process's own mount namespace (where another file is mounted over it)."""
    owner = pwd.getpwnam(other_user())
    held, other = daemon_root / "held", daemon_root / "other"
    for path in (held, other):
        path.write_bytes(b"readable")
        os.chown(path, owner.pw_uid, owner.pw_gid)
    holder, fd = start_holder(SHADOWED, held, other, owner.pw_uid, owner.pw_gid)
    try:
        problems = reopened_problems(holder.pid)
        assert problems == [f"fd {fd} {held}: the path leads to another file than the one the process held"]
    finally:
        holder.kill()
        holder.wait()


JOB = """
import os, sys, time
data, release = sys.argv[1], sys.argv[2]
fd = os.open(data, os.O_RDWR)
while not os.path.exists(release):
    os.lseek(fd, 0, 0)
    print(os.read(fd, 8).decode(), flush=True)
    time.sleep(0.05)
os.lseek(fd, 0, 0)
os.write(fd, b"WRITTEN!")
print("end", flush=True)
"""


@requires_root
@pytest.mark.slow
@pytest.mark.parametrize("change", ["swapped", "taken"])
def test_a_restore_that_would_hand_the_job_a_file_its_user_may_not_open_is_refused(
    daemon_root: Path, change: str
) -> None:
    """Between suspend and resume, the job's user swaps a folder on the path of a file the job
    holds for a link to a root-only folder (CRIU, under the restore guard, opens through a link
    only as the user), or root takes that file (no link: CRIU opens it, the check after refuses):
    either way the restore is refused, the job stays suspended with its checkpoint, root's file is
    untouched; once put back, the job resumes and ends as it would have."""
    owner = pwd.getpwnam(other_user())
    python = python_of(owner.pw_name)
    home = daemon_root / "home"
    home.mkdir()
    (home / "mine").mkdir()
    (home / "mine" / "data").write_bytes(b"ownbytes")
    for path in (home, home / "mine", home / "mine" / "data"):
        os.chown(path, owner.pw_uid, owner.pw_gid)
    room = daemon_root / "room"
    room.mkdir(mode=0o700)
    (room / "data").write_bytes(b"rootonly")
    for path in (room / "data", home / "mine" / "data"):
        os.chmod(path, 0o600)
    release = daemon_root / "release"
    script = home / "job.py"
    script.write_text(JOB)
    with running_daemon(daemon_root, virtual_devices=1) as daemon:
        job = daemon.submit(
            *python, str(script), str(home / "mine" / "data"), str(release), user=owner.pw_name
        )
        daemon.wait_state(job, "RUNNING")
        wait_until(lambda: "ownbytes" in daemon.sing("logs", str(job)).out, timeout=60)
        assert daemon.sing("suspend", str(job), user=owner.pw_name).code == 0
        held = home / "mine" / "data"
        if change == "swapped":
            (home / "mine").rename(home / "put-aside")
            (home / "mine").symlink_to(room)
        else:
            os.chown(held, 0, 0)
        refused = daemon.sing("resume", "--wait", str(job), user=owner.pw_name, timeout=120)
        assert refused.code != 0
        if change == "swapped":
            assert "a file the job held is not its user's to open by its path now" in refused.err, refused.err
        else:
            assert "restore refused, the checkpoint is kept" in refused.err, refused.err
            assert f"fd 3 {held}: its user may not open it" in refused.err, refused.err
        assert "Traceback" not in refused.err
        assert daemon.job(job)["state"] == "SUSPENDED"
        assert (room / "data").read_bytes() == b"rootonly"
        if change == "swapped":
            resumes_once_put_back(daemon, job, owner.pw_name, home / "mine", home / "put-aside", release)
        else:
            os.chown(held, owner.pw_uid, owner.pw_gid)
            assert daemon.sing("resume", "--wait", str(job), user=owner.pw_name, timeout=120).code == 0
            release.touch()
            daemon.wait_ok(job, timeout=120)
        assert daemon.sing("logs", str(job)).out.splitlines()[-1] == "end"
    assert (home / "mine" / "data").read_bytes() == b"WRITTEN!"
    assert (room / "data").read_bytes() == b"rootonly"


LISTENER = """
import os, socket, sys, time
path, release = sys.argv[1], sys.argv[2]
listener = socket.socket(socket.AF_UNIX)
listener.bind(path)
listener.listen()
print("bound", flush=True)
while not os.path.exists(release):
    time.sleep(0.05)
print("end", flush=True)
"""


def users_socket_folder_and_roots_socket(
    root: Path, owner: pwd.struct_passwd
) -> tuple[Path, Path, socket.socket, Path]:
    """The scene of a socket swap under `root`: `owner`'s folder home (with home/run, where
    LISTENER, written as home/listener.py, is to bind), and root's folder room holding root's
    socket (open until closed); (home, room, root's socket, the script)."""
    home = root / "home"
    (home / "run").mkdir(parents=True)
    for path in (home, home / "run"):
        os.chown(path, owner.pw_uid, owner.pw_gid)
    room = root / "room"
    room.mkdir()
    roots = socket.socket(socket.AF_UNIX)
    roots.bind(str(room / "sock"))
    script = home / "listener.py"
    script.write_text(LISTENER)
    return home, room, roots, script


@requires_root
@pytest.mark.slow
def test_a_restore_that_would_bind_a_root_jobs_socket_through_a_users_link_is_refused(
    daemon_root: Path,
) -> None:
    """CRIU unlinks what is at a bound socket's path and binds there, as root (a root job's restore
    runs without the restore guard): a user who owns the folder of the job's socket swaps it for a
    link to root's folder holding root's socket; the restore is refused before CRIU runs, root's
    socket stays, and with the folder put back the job resumes."""
    owner = pwd.getpwnam(other_user())
    python = python_of(owner.pw_name)
    home, room, roots, script = users_socket_folder_and_roots_socket(daemon_root, owner)
    release = daemon_root / "release"
    try:
        with running_daemon(daemon_root, virtual_devices=1) as daemon:
            job = daemon.submit(*python, str(script), str(home / "run" / "sock"), str(release))
            wait_until(lambda: "bound" in daemon.sing("logs", str(job)).out, timeout=60)
            assert daemon.sing("suspend", str(job)).code == 0
            (home / "run").rename(home / "put-aside")
            (home / "run").symlink_to(room)
            os.lchown(home / "run", owner.pw_uid, owner.pw_gid)
            refused = daemon.sing("resume", "--wait", str(job), timeout=120)
            assert refused.code != 0 and "restore refused, the checkpoint is kept" in refused.err, refused.err
            assert (
                f"a Unix socket bound to {home / 'run' / 'sock'}: {home / 'run'} is now a link" in refused.err
            )
            assert (room / "sock").is_socket() and (room / "sock").stat().st_uid == 0
            assert daemon.job(job)["state"] == "SUSPENDED"
            resumes_once_put_back(daemon, job, "root", home / "run", home / "put-aside", release)
    finally:
        roots.close()


STOPS_ITS_WORKER = """
import os, signal, sys, time
release = sys.argv[1]
worker = os.fork()
if worker == 0:
    while True:
        print("working", flush=True)
        time.sleep(0.05)
time.sleep(0.3)
os.kill(worker, signal.SIGSTOP)
os.waitpid(worker, os.WUNTRACED)
print("stopped the worker", flush=True)
while not os.path.exists(release):
    time.sleep(0.05)
print("released", flush=True)
time.sleep(0.5)
os.kill(worker, signal.SIGCONT)
time.sleep(0.3)
os.kill(worker, signal.SIGKILL)
print("end", flush=True)
"""


@requires_root
@pytest.mark.slow
def test_a_process_its_user_stopped_stays_stopped_across_a_preemption(daemon_root: Path) -> None:
    """A restore leaves every process stopped until it has checked them, then lets them run: but not
    one the job had stopped itself, which runs again only when the job continues it."""
    script = daemon_root / "stopper.py"
    script.write_text(STOPS_ITS_WORKER)
    release = daemon_root / "release"
    with running_daemon(daemon_root, virtual_devices=1) as daemon:
        job = daemon.submit(*python_of("root"), str(script), str(release))
        wait_until(lambda: "stopped the worker" in daemon.sing("logs", str(job)).out, timeout=60)
        assert daemon.sing("suspend", str(job)).code == 0
        resumed = daemon.sing("resume", "--wait", str(job), timeout=120)
        assert resumed.code == 0, resumed.err
        time.sleep(1)
        release.touch()
        daemon.wait_ok(job, timeout=120)
        lines = daemon.sing("logs", str(job)).out.splitlines()
    stopped, released = lines.index("stopped the worker"), lines.index("released")
    assert "working" not in lines[stopped:released], lines
    assert "working" in lines[released:], "continued by the job, the worker works again"
