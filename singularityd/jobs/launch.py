"""Starting a job: its launch spec (command, user, per-rank environment, files) and the launcher.

The launcher (singularityd/jobs/launcher.py) runs as `python -S launcher.py SPEC.json`, forks the
job's supervisor and exits at once; the supervisor is therefore not the daemon's child, and the
daemon learns its host PID from the launcher's output. Where root cannot checkpoint another
user's processes directly, their jobs run in a user namespace the daemon owns; whether that works
here is tried once at start (`probe_user_namespaces`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import pwd
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from singularityd.checkpoint.store import rewind_files
from singularityd.jobs import launcher
from singularityd.jobs.paths import JobPaths
from singularityd.store import JobRecord

LAUNCHER = Path(launcher.__file__)
WITHOUT_AMX = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_FP16", "MKL_ENABLE_INSTRUCTIONS": "AVX512_E3"}
"""The best instruction sets without AMX for oneDNN and MKL (torch's CPU kernels for bfloat16
matrix products), the default of a job on a CPU with AMX: see `cpu_has_amx`."""


class LaunchError(Exception):
    """The job's processes could not be started; the message says why."""


def prepare_job_dir(paths: JobPaths) -> None:
    """Create the job's folders.

    As root they belong to root (mode 0711), so the files root writes there (status, PID, the
    logs it opens) cannot be swapped for links by the job's user; each log file is the user's
    own, readable by them alone. In user mode everything is the user's, mode 0700.
    """
    paths.logs.mkdir(parents=True, exist_ok=True)
    mode = 0o711 if os.geteuid() == 0 else 0o700
    for folder in (paths.root, paths.logs):
        if folder.is_symlink() or not folder.is_dir():
            raise LaunchError(f"{folder} is not a directory")
        os.chmod(folder, mode)
        if os.geteuid() == 0:
            os.chown(folder, 0, 0)


@functools.cache
def cpu_has_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has AMX tiles. A process must ask the kernel for AMX
    (arch_prctl ARCH_REQ_XCOMP_PERM); CRIU does not restore that permission, so a job that used
    AMX before a checkpoint dies of SIGILL at its next tile instruction after the restore."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []
    )
    return "amx_tile" in flags


def free_tcp_port() -> int:
    """A TCP port on the loopback that is free now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def rank_environments(
    base: dict[str, str],
    *,
    job_id: int,
    user: str,
    ranks: int,
    devices: tuple[int, ...],
    device_env: Mapping[str, str],
    master_port: int,
) -> list[dict[str, str]]:
    """The environment of each rank: the user's, plus what torchrun and singularityd provide.

    Every variable torchrun gives a worker of a single-node run is there (rank, role and group
    sizes, TORCHELASTIC_*), so programs and libraries that detect torchrun by them (Lightning's
    TorchElasticEnvironment) see it. The ranks make their own store (no agent's), and torchrun's
    restarts are the daemon's resumes, which restore the processes' memory: the count stays 0.
    A job of one rank on several devices is one program that uses them itself, as on a
    workstation (nn.DataParallel, mp.spawn, Lightning's own launcher): it gets none of them,
    which would tell such a program that its world is one process.

    Ranks of a job of several get OMP_NUM_THREADS=1 unless the user set it, as torchrun gives its
    workers when it starts more than one (their host computations' bits depend on it).
    USER and LOGNAME always name the job's real user, whatever the request carried.
    USE_LIBUV defaults to 0: torch's libuv TCPStore creates an io_uring, which CRIU cannot dump.
    ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS default to the best sets without AMX on a CPU
    with AMX (`cpu_has_amx`).
    `device_env` says how the job reaches its devices (the proxy client, or CUDA_VISIBLE_DEVICES).
    """
    identity = {"USER": user, "LOGNAME": user}
    defaults: dict[str, str] = {}
    try:
        account = pwd.getpwnam(user)
        defaults = {"HOME": account.pw_dir, "SHELL": account.pw_shell}
    except KeyError:
        pass
    listed = ",".join(str(d) for d in devices)
    environments = []
    defaults["USE_LIBUV"] = "0"
    if cpu_has_amx():
        defaults.update(WITHOUT_AMX)
    launched_by_torchrun = ranks > 1 or len(devices) <= 1
    for rank in range(ranks):
        env = {**defaults, **base, **identity}
        if launched_by_torchrun:
            env.update(torchrun_variables(rank, ranks, master_port, job_id))
            if ranks > 1:
                env.setdefault("OMP_NUM_THREADS", "1")
        env.update({"SING_JOB_ID": str(job_id), "SING_DEVICES": listed})
        env.update(device_env)
        environments.append(env)
    return environments


def torchrun_variables(rank: int, ranks: int, master_port: int, job_id: int) -> dict[str, str]:
    """What torchrun's local agent gives worker `rank` of a one-node run of `ranks` workers."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": str(ranks),
        "LOCAL_WORLD_SIZE": str(ranks),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(ranks),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": f"sing-{job_id}",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }


def user_groups(user: str, gid: int) -> list[int]:
    """The supplementary groups the user's jobs run with."""
    try:
        return os.getgrouplist(user, gid)
    except OSError:
        return [gid]


def launch_spec(
    job: JobRecord,
    paths: JobPaths,
    device_env: Mapping[str, str],
    *,
    pid_namespace: bool,
    kill_grace_seconds: float,
    user_namespace: bool = False,
    network_namespace: bool = False,
) -> dict[str, Any]:
    """Create the job's folder and return what the launcher needs to start it.

    `user_namespace` also puts the job in a user namespace owned by root (with its own mount
    namespace and /proc); `network_namespace` gives it a network with only a loopback device.
    """
    spec = job.spec
    prepare_job_dir(paths)
    return {
        "job_id": job.id,
        "uid": spec.uid,
        "gid": spec.gid,
        "user": spec.user,
        "groups": user_groups(spec.user, spec.gid),
        "command": list(spec.command),
        "cwd": spec.cwd,
        "rank_envs": rank_environments(
            spec.env,
            job_id=job.id,
            user=spec.user,
            ranks=spec.ranks,
            devices=job.devices,
            device_env=device_env,
            master_port=free_tcp_port(),
        ),
        "rank_logs": [str(paths.rank_log(r)) for r in range(spec.ranks)],
        "supervisor_log": str(paths.supervisor_log),
        "status_path": str(paths.status),
        "pid_path": str(paths.pid),
        "pid_namespace": pid_namespace,
        "user_namespace": user_namespace,
        "network_namespace": network_namespace,
        "kill_grace_seconds": kill_grace_seconds,
    }


async def run_launcher(spec: dict[str, Any], paths: JobPaths) -> int:
    """Start a job through the launcher; returns the supervisor's host PID.

    The job runs from its command, so the logs of an earlier run of it (a restart from the
    beginning, a launch a daemon restart interrupted) are emptied: their lines would repeat.
    """
    for stale in (paths.status, paths.pid):
        stale.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # no room now: the status is written without a reserve
        launcher.reserve_status(str(paths.status))
    rewind_files(dict.fromkeys([*spec["rank_logs"], spec["supervisor_log"]], 0))
    paths.spec.unlink(missing_ok=True)
    fd = os.open(paths.spec, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(spec, handle)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-S",
        str(LAUNCHER),
        str(paths.spec),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    if process.returncode != 0:
        detail = err.decode(errors="replace").strip().splitlines()
        raise LaunchError(detail[-1] if detail else f"launcher exited with {process.returncode}")
    return int(out.decode().strip())


def probe_user_namespaces() -> str:
    """Try, once, to start an init in the namespaces a job would get; "" if it works, else why."""
    try:
        done = subprocess.run(
            [sys.executable, "-S", str(LAUNCHER), launcher.PROBE_FLAG],
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as error:
        return f"the launcher did not run: {error}"
    if done.returncode == 0:
        return ""
    lines = (done.stdout + done.stderr).strip().splitlines()
    return lines[-1] if lines else f"the trial exited with {done.returncode}"
