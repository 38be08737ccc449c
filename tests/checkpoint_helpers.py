"""Jobs for the checkpoint tests and benchmark, started by the daemon's own launcher.

`start_job` runs a command the way the daemon runs a job (singularityd.jobs.launch): a PID
namespace whose init is the job's supervisor, one process per rank as the job's user, O_APPEND
logs, a status file when it ends. The launcher exits at once, so the supervisor is reparented
away from the caller, as under the daemon. `launch_job` starts one for a test (killed at its end),
`finish_job` waits for one to succeed; the job scripts (TRAIN, COUNTER) wait for the test's
release file before their last line. The rest are small /proc helpers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import select
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from singularityd.checkpoint import Checkpointer, Criu, CriuInfo, ImageStore
from singularityd.core.states import JobState
from singularityd.jobs.launch import launch_spec, run_launcher
from singularityd.jobs.paths import JobPaths
from singularityd.store import JobRecord, JobSpec


@dataclass(frozen=True)
class LaunchedJob:
    """A job's process tree: the host PID of its supervisor (the root to checkpoint), its files."""

    pid: int
    paths: JobPaths

    def log(self, rank: int = 0) -> Path:
        """stdout and stderr of one rank."""
        return self.paths.rank_log(rank)

    def status(self) -> dict[str, Any]:
        """What the supervisor recorded when the job ended."""
        data: dict[str, Any] = json.loads(self.paths.status.read_text())
        return data


async def start_job(
    folder: Path,
    command: Sequence[str],
    *,
    ranks: int = 1,
    uid: int = 0,
    gid: int = 0,
    user: str = "root",
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> LaunchedJob:
    """Start `command` (every rank runs it, told its RANK) as the daemon would; files in `folder`."""
    spec = JobSpec(
        name=folder.name, uid=uid, gid=gid, user=user, priority=0, gpus=1, ranks=ranks,
        command=tuple(command), env=dict(env or {}), cwd=str(cwd or folder.parent),
    )  # fmt: skip
    job = JobRecord(
        id=1, spec=spec, state=JobState.RUNNING, reason="test", pending_reason="", cancel_requested=False,
        submitted_at=0.0, started_at=None, ended_at=None, exit_code=None, signal=None, cpu_seconds=None,
        max_rss_bytes=None, attempt=1, init_pid=None, init_start_ticks=None, devices=(),
    )  # fmt: skip
    paths = JobPaths(folder)
    launch = launch_spec(job, paths, {}, pid_namespace=True, kill_grace_seconds=5.0)
    return LaunchedJob(await run_launcher(launch, paths), paths)


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


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (e.g. "8m") mounted on a new folder `path`, unmounted afterwards."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


SYSTEM_PYTHON = "/usr/bin/python3"
"""A Python without torch, for jobs that need none (they start faster)."""
TEST_USER = "sing-test-job"
"""The user that checkpoint tests run jobs as when the job must not be root's."""

# The job scripts below wait before their last line for the test's release file (the last argument).
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


def checkpointer_in(info: CriuInfo, root: Path, keep: int = 3) -> Checkpointer:
    """A checkpointer with this CRIU keeping the newest `keep` checkpoints of each job under `root`."""
    return Checkpointer(Criu(info), ImageStore(root), keep=keep)


def write_script(work: Path, name: str, text: str) -> str:
    """Write a job's script into `work`, readable by every user; its path."""
    p = work / name
    p.write_text(text)
    p.chmod(0o644)
    return str(p)


def _job_env() -> dict[str, str]:
    """The environment of a test job: torch.distributed without libuv (CRIU cannot dump io_uring)."""
    return {
        "PATH": "/usr/bin:/bin",
        "USE_LIBUV": "0",
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }


def launch_job(
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
    job = asyncio.run(
        start_job(work / name, command, ranks=ranks, uid=uid, gid=gid, user=login, env=_job_env(), cwd=work)
    )
    jobs.append(job.pid)
    return job


def counting_job(
    work: Path,
    name: str,
    jobs: list[int],
    count: int = 100_000,
    *,
    user: pwd.struct_passwd | None = None,
    shown: str = "2\n",
) -> LaunchedJob:
    """A COUNTER job printing 0 to `count` - 1 (then "done" once `work`/release exists), returned
    when it has printed `shown`."""
    script = write_script(work, "count.py", COUNTER)
    job = launch_job(work, name, [SYSTEM_PYTHON, script, str(count), str(work / "release")], jobs, user=user)
    assert wait_for_line(job.log(), shown, 30)
    return job


def track(jobs: list[int], pid: int) -> int:
    """Add a (restored) job's PID to those the test kills at its end; the PID."""
    jobs.append(pid)
    return pid


def finish_job(pid: int, job: LaunchedJob, timeout: float = 60) -> dict[str, Any]:
    """Wait for the job's (possibly restored) supervisor to end; its status, which must be success."""
    assert wait_exit(pid, timeout), f"job {pid} did not finish"
    status = job.status()
    assert (status["exit_code"], status["signal"]) == (0, None), status
    return status


def finish_counting(pid: int, job: LaunchedJob, jobs: list[int], release: Path, count: int) -> None:
    """Let a (restored) COUNTER job end: it must succeed having printed 0 to `count` - 1, then
    "done", each exactly once."""
    track(jobs, pid)
    release.touch()
    finish_job(pid, job)
    assert job.log().read_text() == "".join(f"{i}\n" for i in range(count)) + "done\n"
