"""Whether a restored job may keep the files CRIU reopened for it, checked before it runs.

CRIU restores as root and reopens every file, folder and mapped file of the dumped processes by
its path. By then a path may lead elsewhere: the job's user can swap a folder on it for a link
between the checkpoint and the restore, and root would hand their process a file they may not
open. So CRIU leaves the restored processes stopped, and each process not running as root has
what it holds opened again by path as its own user, in its mount namespace and root (see
reopen_probe.py): every path must lead to the same file, which that user may access as the
process does (inotify and fanotify watches, restored by path too, included: the inode each
watches must be one its user may read). `held_files` reads what a process holds from /proc (pure
parsers beside it);
`reopened_problems` runs the probe. What CRIU makes again by path before the processes exist (bound
Unix sockets, deleted files) is checked before it runs: `named_path_problems`.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import stat
import struct
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from singularityd.checkpoint import reopen_probe
from singularityd.checkpoint.image_files import made_by_name
from singularityd.checkpoint.namespaces import parse_mountinfo
from singularityd.checkpoint.precheck import status_fields, tree_pids

PROBE = Path(reopen_probe.__file__)
PROBE_TIMEOUT_S = 60.0
_libc = ctypes.CDLL(None, use_errno=True)
O_PATH = 0o10000000


@dataclass(frozen=True)
class HeldFile:
    """A file a process holds by a path: how it may use it, and which file it is."""

    path: str
    access: int
    dev: int
    ino: int
    what: str


@dataclass(frozen=True)
class Holder:
    """A restored process that runs as a user, and the files it holds."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...]
    namespace: int
    files: tuple[HeldFile, ...]

    @property
    def user_and_view(self) -> tuple[int, int, tuple[int, ...], int]:
        """Who checks its files and in which mount namespace: processes alike share one probe."""
        return self.uid, self.gid, self.groups, self.namespace


def fd_access(flags: int) -> int:
    """The access an open file's flags (octal in fdinfo) give: R_OK, W_OK or both (0 for O_PATH)."""
    if flags & O_PATH:
        return 0
    mode = flags & os.O_ACCMODE
    if mode == os.O_WRONLY:
        return os.W_OK
    if mode == os.O_RDWR:
        return os.R_OK | os.W_OK
    return os.R_OK


def mapping_access(perms: str) -> int:
    """The access a file mapping needs ("rw-s" and the like): reading, and writing for a shared
    writable one (a private one copies on write)."""
    return os.R_OK | (os.W_OK if perms[1:2] == "w" and perms[3:4] == "s" else 0)


def by_path(target: str) -> bool:
    """Whether a /proc link target is a path (not a socket, pipe or anonymous file, which CRIU
    rebuilds from the images; a deleted file is told by its link count, not by its name)."""
    return target.startswith("/")


def mapped_files(maps: str) -> list[tuple[str, str]]:
    """(address range, permissions) of each mapping of a file in /proc/PID/maps (its path is read
    from map_files, which does not escape it)."""
    found = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and by_path(fields[5]):
            found.append((fields[0], fields[1]))
    return found


def file_ids(status: str) -> tuple[int, int, tuple[int, ...]] | None:
    """The filesystem uid and gid and the groups in /proc/PID/status (None if unreadable)."""
    lines = status_fields(status)
    try:
        uid = int(lines["Uid"].split()[3])
        gid = int(lines["Gid"].split()[3])
        groups = tuple(sorted(int(g) for g in lines.get("Groups", "").split()))
    except (KeyError, IndexError, ValueError):
        return None
    return uid, gid, groups


def _held(at: str, access: int, what: str) -> HeldFile | None:
    """The file at /proc link `at`, if CRIU reopens it by path: not one deleted (no link left,
    whatever its name says), whose content CRIU restores from the images."""
    try:
        target = os.readlink(at)
        if not by_path(target):
            return None
        st = os.stat(at)
    except OSError:
        return None
    if st.st_nlink == 0:
        return None
    return HeldFile(target, access, st.st_dev, st.st_ino, what)


@dataclass(frozen=True)
class Watch:
    """An inode an inotify or fanotify descriptor watches (CRIU restores the watch by a path it
    recorded, so it too may now watch another inode), with the file handle that finds it."""

    dev: int
    ino: int
    handle_type: int
    handle: bytes


def watches(fdinfo: str) -> list[Watch]:
    """The inodes an inotify or fanotify descriptor's /proc fdinfo says it watches (pure)."""
    found = []
    for line in fdinfo.splitlines():
        if not line.startswith(("inotify ", "fanotify ")):
            continue
        items = dict(item.split(":", 1) for item in line.split()[1:] if ":" in item)
        try:
            sdev = int(items["sdev"], 16)  # the kernel's own encoding: major << 20 | minor
            handle = bytes.fromhex(items["f_handle"])
            found.append(
                Watch(
                    os.makedev(sdev >> 20, sdev & 0xFFFFF),
                    int(items["ino"], 16),
                    int(items["fhandle-type"], 16),
                    handle,
                )
            )
        except (KeyError, ValueError):
            continue
    return found


def mount_point_of(mountinfo: str, dev: int) -> str | None:
    """Where a file system of device `dev` is mounted, from /proc/PID/mountinfo (pure)."""
    wanted = f"{os.major(dev)}:{os.minor(dev)}"
    for mount in parse_mountinfo(mountinfo):
        if mount.device == wanted:
            return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), mount.mount_point)
    return None


def _watched(pid: int, watch: Watch, what: str) -> HeldFile | None:
    """The watched inode, by the path it has now (found by its file handle); None if it cannot be
    found (a watch on an inode gone: nothing of it to read)."""
    try:
        point = mount_point_of(Path(f"/proc/{pid}/mountinfo").read_text(), watch.dev)
        if point is None:
            return None
        mount = os.open(f"/proc/{pid}/root{point}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        handle = struct.pack("Ii", len(watch.handle), watch.handle_type) + watch.handle
        fd = _libc.open_by_handle_at(mount, ctypes.create_string_buffer(handle, len(handle)), O_PATH)
    finally:
        os.close(mount)
    if fd < 0:
        return None
    try:
        st = os.fstat(fd)
        return HeldFile(os.readlink(f"/proc/self/fd/{fd}"), os.R_OK, st.st_dev, st.st_ino, what)
    except OSError:
        return None
    finally:
        os.close(fd)


def held_files(pid: int) -> Holder | None:
    """What process `pid` holds by path and whom it runs as (None for root or a process gone)."""
    base = f"/proc/{pid}"
    try:
        ids = file_ids(Path(f"{base}/status").read_text())
        namespace = os.stat(f"{base}/ns/mnt").st_ino
    except OSError:
        return None
    if ids is None or ids[0] == 0:
        return None
    found: list[HeldFile | None] = [
        _held(f"{base}/cwd", os.X_OK, "the working directory"),
        _held(f"{base}/exe", os.X_OK, "the program"),
    ]
    try:
        fds = os.listdir(f"{base}/fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            info = Path(f"{base}/fdinfo/{fd}").read_text()
            flags = next(int(line.split()[1], 8) for line in info.splitlines() if line.startswith("flags:"))
        except (OSError, StopIteration, ValueError, IndexError):
            continue
        found.append(_held(f"{base}/fd/{fd}", fd_access(flags), f"fd {fd}"))
        found += [_watched(pid, watch, f"a watch of fd {fd}") for watch in watches(info)]
    try:
        maps = Path(f"{base}/maps").read_text()
    except OSError:
        maps = ""
    for span, perms in mapped_files(maps):
        found.append(_held(f"{base}/map_files/{span}", mapping_access(perms), "a mapped file"))
    files = tuple(dict.fromkeys(f for f in found if f is not None))
    return Holder(pid, ids[0], ids[1], ids[2], namespace, files)


def probe_requests(holders: Iterable[Holder]) -> list[dict[str, object]]:
    """One probe request for each user and view of the files, each file once (pure)."""
    groups: dict[
        tuple[int, int, tuple[int, ...], int], tuple[Holder, dict[tuple[str, int, int, int], str]]
    ] = {}
    for holder in holders:
        _, files = groups.setdefault(holder.user_and_view, (holder, {}))
        for each in holder.files:
            files.setdefault((each.path, each.access, each.dev, each.ino), each.what)
    return [
        {
            "pid": first.pid,
            "uid": first.uid,
            "gid": first.gid,
            "groups": list(first.groups),
            "files": [[*key, what] for key, what in files.items()],
        }
        for first, files in groups.values()
    ]


def reopened_problems(root: int) -> list[str]:
    """Why the processes restored under `root` may not keep what CRIU reopened for them; a blocking
    function (call it through asyncio.to_thread). A probe that cannot check counts as a problem."""
    holders = [h for h in (held_files(pid) for pid in tree_pids(root)) if h is not None]
    problems: list[str] = []
    for request in probe_requests(holders):
        problems += _run_probe(request)
    return problems


def _run_probe(request: dict[str, object]) -> list[str]:
    """Run the probe on one request; its problems, or why it could not check."""
    try:
        done = subprocess.run(
            [sys.executable, "-S", str(PROBE)],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
        problems = json.loads(done.stdout) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError) as error:
        return [f"the files of pid {request['pid']} could not be checked: {error}"]
    if not isinstance(problems, list):
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return [f"the files of pid {request['pid']} could not be checked: {last}"]
    return [str(p) for p in problems]


def link_on_the_way(path: str) -> str:
    """The first folder on the way to `path` (its last name aside) that is now a link owned by
    another than root, said plainly, or ''; such a link, put there since the checkpoint, would
    take what CRIU unlinks, binds, creates or gives an owner there by path, as root, elsewhere."""
    current = ""
    for part in [p for p in path.split("/") if p][:-1]:
        current += f"/{part}"
        try:
            found = os.lstat(current)
        except OSError:
            return ""
        if stat.S_ISLNK(found.st_mode) and found.st_uid != 0:
            return f"{current} is now a link owned by uid {found.st_uid}"
    return ""


def named_path_problems(images: Path) -> list[str]:
    """Why CRIU may not make again by path what the images hold (bound Unix sockets, deleted files:
    image_files.made_by_name): a link on the way that root does not own; a blocking function."""
    problems = []
    for what, path in made_by_name(images):
        link = link_on_the_way(path)
        if link:
            problems.append(f"{what} {path}: {link}")
    return problems
