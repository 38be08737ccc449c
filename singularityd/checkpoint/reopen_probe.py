"""Opens again, as a restored process's user, the files CRIU reopened for it as root.

Run by the daemon (singularityd.checkpoint.reopened) as root, `python -S reopen_probe.py`, with
one JSON object on stdin: {"pid": a restored process, "uid", "gid", "groups", "files": [[path,
access, dev, ino, what], ...]}. It enters that process's mount namespace and root, drops to the
user, opens each path (O_PATH: no side effect, and only the folders on the way need permission),
checks that it leads to the very file the process holds, and that the user may access that file
as the process does (faccessat through the opened file, so a swap in between changes nothing).
It prints a JSON list of problems, one line each, and exits 0; anything else means it could not
check. Standalone (the standard library only), like the launcher.
"""

from __future__ import annotations

import ctypes
import json
import os
import stat
import sys
from typing import Any

CLONE_NEWNS = 0x00020000


def access_words(access: int, folder: bool) -> str:
    """'open it for reading and writing' for R_OK | W_OK, 'enter it' for a folder's X_OK, and so on."""
    words = [word for bit, word in ((os.R_OK, "reading"), (os.W_OK, "writing")) if access & bit]
    opened = f"open it for {' and '.join(words)}" if words else ""
    run = ("enter it" if folder else "run it") if access & os.X_OK else ""
    return " or ".join(part for part in (opened, run) if part)


def enter(pid: int) -> int:
    """Enter the mount namespace and root of process `pid`; return an fd of this host's /proc."""
    proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    root = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    namespace = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(namespace, CLONE_NEWNS) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns(mnt of {pid}): {os.strerror(errno)}")
    os.fchdir(root)
    os.chroot(".")
    os.close(root)
    os.close(namespace)
    return proc


def become(uid: int, gid: int, groups: list[int]) -> None:
    """Drop to the user, with exactly their groups."""
    os.setgroups(groups)
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def allowed(proc: int, fd: int, access: int) -> bool:
    """Whether this process may access the very file open as `fd` (through /proc, not its path)."""
    return os.access(f"self/fd/{fd}", access, dir_fd=proc)


def problem_of(proc: int, path: str, access: int, dev: int, ino: int, what: str) -> str:
    """Why the user may not hold `path` as the process does ('' when they may)."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError as error:
        return f"{what} {path}: its user cannot reach it ({error.strerror})"
    try:
        held = os.fstat(fd)
        if (held.st_dev, held.st_ino) != (dev, ino):
            return f"{what} {path}: the path leads to another file than the one the process held"
        denied = sum(
            bit for bit in (os.R_OK, os.W_OK, os.X_OK) if access & bit and not allowed(proc, fd, bit)
        )
        if denied:
            return f"{what} {path}: its user may not {access_words(denied, stat.S_ISDIR(held.st_mode))}"
        return ""
    finally:
        os.close(fd)


def main() -> int:
    """Check the files given on stdin; print the problems as a JSON list."""
    request: dict[str, Any] = json.load(sys.stdin)
    proc = enter(int(request["pid"]))
    become(int(request["uid"]), int(request["gid"]), [int(g) for g in request["groups"]])
    problems = [problem_of(proc, *each) for each in request["files"]]
    json.dump([p for p in problems if p], sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
