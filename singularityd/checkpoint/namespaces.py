"""A job's namespaces as CRIU must be told about them: its external mounts and its user namespace.

A job that runs in a user namespace owned by the daemon (see singularityd/jobs/launcher.py) has a mount
namespace of its own, copied from the daemon's, with a /proc of its PID namespace. CRIU dumps that
namespace and recreates it, inside a new user namespace, on restore. Every mount the job shares
with the daemon is named as external at the dump (`--external mnt[PATH]:NAME`); the restore runs
CRIU through the launcher's `--restore-mounts` mode, which gives CRIU each of those mounts, and
the root, as a bind mount of its own (see `launcher.exec_in_mount_yard` for why).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from singularityd.jobs import launcher

NS_GET_PARENT = 0xB702
NS_GET_OWNER_UID = 0xB704
MOUNT_NAME_PREFIX = "m"

ExternalMounts = Mapping[str, str]
"""A job's external mounts: the name CRIU's images use for each, and its mount point."""


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/PID/mountinfo: which filesystem (device and root) is mounted where."""

    mount_id: int
    device: str
    root: str
    mount_point: str
    fstype: str


def parse_mountinfo(text: str) -> list[MountEntry]:
    """The mounts listed in a mountinfo file, in its order (mount points still escaped)."""
    entries = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 7 or "-" not in fields[6:]:
            continue
        separator = fields.index("-", 6)
        entries.append(
            MountEntry(
                mount_id=int(fields[0]),
                device=fields[2],
                root=fields[3],
                mount_point=fields[4],
                fstype=fields[separator + 1] if len(fields) > separator + 1 else "",
            )
        )
    return entries


def external_mount_names(job: Sequence[MountEntry], ours: Sequence[MountEntry]) -> dict[str, str]:
    """Name each of the job's mounts that the daemon also has (same device and root); pure.

    The job's root mount is restored from `--root`, and mounts the job made itself (its /proc)
    are CRIU's to recreate, so neither is named. Mounts stacked on one mount point share a name.
    Raises ValueError for a mount point CRIU's `--external mnt[...]` option cannot express.
    """
    shared = {(m.device, m.root) for m in ours}
    names: dict[str, str] = {}
    for mount in job:
        if mount.mount_point == "/" or (mount.device, mount.root) not in shared:
            continue
        if "\\" in mount.mount_point or "]" in mount.mount_point:
            raise ValueError(f"the job's mount point {mount.mount_point!r} cannot be named to CRIU")
        if mount.mount_point not in names:
            names[mount.mount_point] = f"{MOUNT_NAME_PREFIX}{len(names)}"
    return {name: point for point, name in names.items()}


def _namespace_inode(pid: int | str, kind: str) -> int:
    return os.stat(f"/proc/{pid}/ns/{kind}").st_ino


def shares_mount_namespace(pid: int) -> bool:
    """Whether the process is in the daemon's own mount namespace."""
    return _namespace_inode(pid, "mnt") == _namespace_inode("self", "mnt")


def read_external_mounts(pid: int) -> dict[str, str] | None:
    """The external mounts of the job rooted at `pid`, or None when it shares our mount namespace.

    Raises ValueError when a mount point cannot be named to CRIU, OSError when the job is gone.
    """
    if shares_mount_namespace(pid):
        return None
    job = parse_mountinfo(Path(f"/proc/{pid}/mountinfo").read_text())
    ours = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    return external_mount_names(job, ours)


@dataclass(frozen=True)
class UserNamespace:
    """Which user namespace a process is in, relative to the daemon's."""

    inode: int
    ours: bool
    owned_by_us: bool


def user_namespace_of(pid: int) -> UserNamespace:
    """The process's user namespace: ours, or a child of ours created by our effective uid, or other."""
    ours = _namespace_inode("self", "user")
    path = f"/proc/{pid}/ns/user"
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        inode = os.fstat(fd).st_ino
        if inode == ours:
            return UserNamespace(inode, ours=True, owned_by_us=True)
        owner = struct.unpack("I", fcntl.ioctl(fd, NS_GET_OWNER_UID, b"\0" * 4))[0]
        parent = -1
        with contextlib.suppress(OSError):
            parent_fd = fcntl.ioctl(fd, NS_GET_PARENT)
            parent = os.fstat(parent_fd).st_ino
            os.close(parent_fd)
    finally:
        os.close(fd)
    return UserNamespace(inode, ours=False, owned_by_us=owner == os.geteuid() and parent == ours)


def restore_argv_in_yard(criu_argv: Sequence[str], mounts: ExternalMounts, yard: Path) -> list[str]:
    """The command that restores a job with its own mount namespace: CRIU through the launcher.

    `criu_argv` is the plain `criu restore ...` command; `yard` an empty directory of the daemon
    (a tmpfs is mounted on it, in CRIU's private mount namespace only).
    """
    root = yard / launcher.YARD_ROOT
    extra = ["--root", str(root), *(f"--external=mnt[{name}]:{yard / name}" for name in mounts)]
    wrapper = [sys.executable, "-S", launcher.__file__, launcher.RESTORE_MOUNTS_FLAG, str(yard)]
    return [*wrapper, json.dumps(dict(mounts)), *criu_argv, *extra]


def dump_mount_args(mounts: ExternalMounts) -> list[str]:
    """CRIU dump options naming each external mount of the job."""
    return [f"--external=mnt[{point}]:{name}" for name, point in mounts.items()]
