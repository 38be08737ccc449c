"""Launch a job's process tree the way the daemon does, for the checkpoint tests and benchmark.

A root launcher unshares a PID namespace and forks; the child is PID 1 of that namespace, calls
setsid, points fd 0 at /dev/null and fds 1 and 2 at an O_APPEND log, drops privileges to the job's
user and acts as the job's init: it starts one process per rank (each with its own O_APPEND log,
stdin /dev/null and PR_SET_PDEATHSIG=SIGKILL) and reaps them. The launcher exits at once, so the
init is reparented away from the caller. This stands in for the daemon's launcher until it exists.

Run as a script, this file is the launcher itself (it reads a JSON job spec on stdin).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

CLONE_NEWPID = 0x20000000
PR_SET_PDEATHSIG = 1
INIT_EXIT_PREFIX = "job-init: exit "


@dataclass(frozen=True)
class RankSpec:
    """One rank of a job: its command line and the log file its stdout and stderr go to."""

    argv: Sequence[str]
    log: Path


@dataclass(frozen=True)
class JobSpec:
    """Everything the launcher needs to start a job's process tree."""

    ranks: Sequence[RankSpec]
    init_log: Path
    uid: int = 0
    gid: int = 0
    cwd: Path = Path("/")
    env: Mapping[str, str] = field(default_factory=dict)
    pid_namespace: bool = True

    def to_json(self) -> str:
        """Serialise the spec for the launcher process."""
        return json.dumps(
            {
                "ranks": [{"argv": list(r.argv), "log": str(r.log)} for r in self.ranks],
                "init_log": str(self.init_log),
                "uid": self.uid,
                "gid": self.gid,
                "cwd": str(self.cwd),
                "env": dict(self.env),
                "pid_namespace": self.pid_namespace,
            }
        )

    @staticmethod
    def from_json(text: str) -> JobSpec:
        """Parse a spec written by `to_json`."""
        raw = json.loads(text)
        return JobSpec(
            ranks=[RankSpec(argv=r["argv"], log=Path(r["log"])) for r in raw["ranks"]],
            init_log=Path(raw["init_log"]),
            uid=int(raw["uid"]),
            gid=int(raw["gid"]),
            cwd=Path(raw["cwd"]),
            env=dict(raw["env"]),
            pid_namespace=bool(raw["pid_namespace"]),
        )


def launch_job(spec: JobSpec) -> int:
    """Start the job's tree and return the host PID of its init (the root to checkpoint)."""
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())],
        input=spec.to_json(),
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"launcher failed ({proc.returncode}): {proc.stderr.strip()}")
    return int(proc.stdout.strip())


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _set_pdeathsig() -> None:
    if _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(127)


def _init_main(spec: JobSpec) -> None:
    os.setsid()
    null = os.open("/dev/null", os.O_RDONLY)
    log = os.open(spec.init_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    env = dict(spec.env)
    procs: dict[int, int] = {}
    for rank, rs in enumerate(spec.ranks):
        fd = os.open(rs.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchown(fd, spec.uid, spec.gid)
        p = subprocess.Popen(
            list(rs.argv),
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=fd,
            cwd=spec.cwd,
            env=env,
            preexec_fn=_set_pdeathsig,
            close_fds=True,
            user=spec.uid,
            group=spec.gid,
            extra_groups=[],
        )
        os.close(fd)
        procs[p.pid] = rank
    codes: dict[int, int] = {}
    while len(codes) < len(procs):
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid in procs:
            codes[procs[pid]] = os.waitstatus_to_exitcode(status)
    worst = next((c for _, c in sorted(codes.items()) if c != 0), 0)
    print(f"{INIT_EXIT_PREFIX}{json.dumps(codes, sort_keys=True)}", flush=True)
    os._exit(worst if worst >= 0 else 128 - worst)


def _launcher_main() -> None:
    spec = JobSpec.from_json(sys.stdin.read())
    if spec.pid_namespace and _libc().unshare(CLONE_NEWPID) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWPID): {os.strerror(err)}")
    pid = os.fork()
    if pid == 0:
        try:
            _init_main(spec)
        finally:
            os._exit(126)
    print(pid, flush=True)
    os._exit(0)


def pid_alive(pid: int) -> bool:
    """Whether a process with this host PID exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_exit(pid: int, timeout: float) -> bool:
    """Wait until the (non-child) process `pid` has exited; return whether it did in time."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        deadline = time.monotonic() + timeout
        while pid_alive(pid):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            select.select([pidfd], [], [], min(left, 0.2))
        return True
    finally:
        os.close(pidfd)


def descendants(pid: int) -> list[int]:
    """Host PIDs of every process below `pid` (children first, depth first)."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tids:
        with contextlib.suppress(FileNotFoundError):
            for child in Path(f"/proc/{pid}/task/{tid}/children").read_text().split():
                out.append(int(child))
                out.extend(descendants(int(child)))
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL a job's init (a PID-namespace init takes its ranks with it) and its descendants."""
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    wait_exit(pid, 10)


def wait_for_line(path: Path, needle: str, timeout: float) -> bool:
    """Wait until a line containing `needle` appears in the file at `path`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            if needle in path.read_text(errors="replace"):
                return True
        time.sleep(0.05)
    return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def socket_inodes(pid: int) -> list[int]:
    """Inodes of the sockets a process has open, in fd order."""
    out: list[int] = []
    for fd in sorted(int(f) for f in os.listdir(f"/proc/{pid}/fd")):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                out.append(int(target[8:-1]))
    return out


def children(pid: int) -> list[int]:
    """Host PIDs of the direct children of a process."""
    return [p for p in descendants(pid) if _ppid(p) == pid]


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return -1


def ns_pids(pid: int) -> list[int]:
    """The PIDs of a process in each PID namespace it is in, outermost first (NSpid)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(x) for x in line.split()[1:]]
    return [pid]


if __name__ == "__main__":
    _launcher_main()
