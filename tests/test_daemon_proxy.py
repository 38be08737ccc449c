"""Unmodified `cuda` programs under the real daemon: proxied virtual devices, preempted and moved.

The corpus runs through `sing submit` on virtual devices (served by proxy servers the daemon
starts for each job, as the job's user) and must print exactly what it prints run directly on
the CPU; a proxied job preempted at random moments, and resumed on another device, must too.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest

from singularityd.checkpoint.shm import copy_path
from tests.conftest import requires_root
from tests.helpers import Daemon, ensure_user, other_user, python_for_user, running_daemon, wait_until
from tests.proxy.conftest import PROGRAMS, PYTHON, base_env
from tests.proxy.test_corpus import CORPUS

JOB_OPTIONS = ["--env", "OMP_NUM_THREADS=1", "--cwd", str(PROGRAMS)]


def direct_run(program: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    """The program run on the CPU, without singularityd or the proxy."""
    done = subprocess.run(
        [PYTHON, program, *args], cwd=PROGRAMS, env=base_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done


def direct_output(program: str, args: list[str]) -> str:
    """The program's stdout on the CPU, without singularityd or the proxy."""
    return direct_run(program, args).stdout


def without_stderr_lines(log: str, stderr: str) -> str:
    """A job log (stdout and stderr together) less the lines the program writes to stderr.

    Those are recognised by their first word, since some say which device was used.
    """
    words = {line.split()[0] for line in stderr.splitlines() if line.strip()}
    return "".join(
        line for line in log.splitlines(keepends=True) if not line.split() or line.split()[0] not in words
    )


@pytest.mark.timeout(900)  # every corpus program twice, with the CPUs shared by parallel test processes
def test_corpus_under_the_daemon_matches_direct_runs(daemon: Daemon) -> None:
    jobs = {
        program: daemon.submit(PYTHON, program, *proxy_args, options=JOB_OPTIONS)
        for program, _, proxy_args in CORPUS
    }
    expected = {program: direct_run(program, direct_args) for program, direct_args, _ in CORPUS}
    for program, job in jobs.items():
        result = daemon.sing("wait", str(job), timeout=600)
        assert result.code == 0, daemon.sing("logs", str(job)).out[-2000:]
        log = daemon.sing("logs", str(job)).out
        assert without_stderr_lines(log, expected[program].stderr) == expected[program].stdout, program
    served = {
        int(p.name.split("-")[1]) for p in (daemon.state_dir / "proxy" / "logs").glob("job-*-dev-*.log")
    }
    assert served == set(jobs.values()), "each job had a proxy server of its own"
    assert not list((daemon.state_dir / "proxy" / "servers").iterdir()), "servers end with their jobs"
    assert not list((daemon.root / "run" / "proxy").iterdir()), "nothing of the jobs stays behind"


def steps(daemon: Daemon, job: int) -> int:
    log = daemon.state_dir / "jobs" / str(job) / "logs" / "rank-0.log"
    return log.read_text().count("step ") if log.exists() else 0


def progressed(daemon: Daemon, job: int, beyond: int, total: int) -> bool:
    """Whether the job printed more than `beyond` steps (or all but one: it holds at the end)."""
    return steps(daemon, job) > min(beyond, total - 1)


@requires_root
def test_proxied_job_preempted_and_moved_is_exact(daemon_root: Path) -> None:
    total = 600
    args = ["--steps", str(total)]
    expected = direct_output("long_train.py", args)
    rng = random.Random(4)
    release = daemon_root / "release"
    with running_daemon(daemon_root, virtual_devices=2) as daemon:
        job = daemon.submit(PYTHON, "long_train.py", *args, "--hold", str(release), options=JOB_OPTIONS)
        first = daemon.wait_state(job, "RUNNING")["devices"]
        seen = 0
        for _ in range(5):
            wait_until(functools.partial(progressed, daemon, job, seen, total), timeout=120)
            time.sleep(rng.uniform(0.0, 0.3))
            result = daemon.sing("preempt", str(job))
            assert result.code == 0, result.err
            daemon.wait_state(job, "RUNNING")
            seen = steps(daemon, job)
        assert daemon.sing("suspend", str(job)).code == 0
        blocker = daemon.submit("sleep", "300", options=["--gpus", "1"])
        assert daemon.wait_state(blocker, "RUNNING")["devices"] == first
        assert daemon.sing("resume", str(job)).code == 0
        moved = daemon.wait_state(job, "RUNNING")
        assert moved["devices"] != first, "resumed on the other device"
        release.touch()
        assert daemon.sing("wait", str(job), timeout=600).code == 0
        assert daemon.sing("logs", str(job)).out == expected
        reasons = [e["reason"] for e in daemon.job(job)["events"]]
        assert sum(r.startswith("restored from checkpoint") for r in reasons) == 6
        daemon.sing("cancel", str(blocker))


def preempted_job_prints_the_direct_output(
    daemon_root: Path,
    program: str,
    args: list[str],
    beyond: Sequence[int],
    step_timeout: float,
    gpus: int = 1,
) -> None:
    """Run `program` (with `args` and a --hold file) on `gpus` virtual devices, preempt it once it
    printed more than each of `beyond` steps, then let it end: it must print what a direct run
    prints (less the lines it writes to stderr), restored once per preemption."""
    direct = direct_run(program, args)
    total = int(args[args.index("--steps") + 1])
    release = daemon_root / "release"
    with running_daemon(daemon_root, virtual_devices=gpus) as daemon:
        options = [*JOB_OPTIONS, "--gpus", str(gpus)]
        job = daemon.submit(PYTHON, program, *args, "--hold", str(release), options=options)
        daemon.wait_state(job, "RUNNING")
        for steps_done in beyond:
            wait_until(functools.partial(progressed, daemon, job, steps_done, total), timeout=step_timeout)
            result = daemon.sing("preempt", str(job))
            assert result.code == 0, result.err
            daemon.wait_state(job, "RUNNING")
        release.touch()
        assert daemon.sing("wait", str(job), timeout=600).code == 0, daemon.sing("logs", str(job)).out[-2000:]
        assert without_stderr_lines(daemon.sing("logs", str(job)).out, direct.stderr) == direct.stdout
        reasons = [e["reason"] for e in daemon.job(job)["events"]]
        assert sum(r.startswith("restored from checkpoint") for r in reasons) == len(beyond)


@requires_root
def test_a_job_fed_by_dataloader_workers_is_preempted_exactly(daemon_root: Path) -> None:
    """A proxied job fed by a DataLoader with 2 worker processes and a pin-memory thread (how most
    training scripts feed a GPU): the thread works on the device, and the job preempted 3 times,
    its workers with it, prints what a direct run prints. Its batches (2 MiB) travel in deleted
    shared memory files, which CRIU carries only up to its ghost file limit (1 MiB unless told)."""
    args = ["--steps", "150", "--width", "16384"]
    preempted_job_prints_the_direct_output(daemon_root, "loader_train.py", args, (10, 50, 100), 120)


@requires_root
def test_a_job_that_uses_one_of_its_devices_is_preempted_exactly(daemon_root: Path) -> None:
    """A program given two devices that uses only its first (as most single-process scripts do):
    the other device's server never saw it, which has nothing to save there (the checkpoint said
    the job had ended); preempted twice, it prints what a direct run prints."""
    args = ["--steps", "120", "--workers", "1"]
    preempted_job_prints_the_direct_output(daemon_root, "loader_train.py", args, (10, 60), 120, gpus=2)


@requires_root
@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_processes_of_a_rank_share_its_device_through_preemptions(daemon_root: Path, start: str) -> None:
    """A job's main process and two workers it starts train on its one device at once, as processes
    share a GPU (the workers were refused: the server kept one session per rank and device); the
    job preempted 3 times, all three processes with it, prints what a direct run prints. Spawned
    workers share the queue's semaphores by name in /dev/shm, which CRIU refused to dump while the
    process that made them mapped them under glibc's deleted temporary name."""
    args = ["--steps", "300", "--start", start]
    preempted_job_prints_the_direct_output(daemon_root, "shared_device.py", args, (20, 120, 220), 180)


@requires_root
def test_processes_talking_over_rpc_are_preempted_exactly(daemon_root: Path) -> None:
    """Pipeline training over torch.distributed.rpc between a job's two processes (a stage on the
    device, concurrent micro-batches, distributed autograd): preempted 3 times as it trains, it
    prints what a direct run prints. TensorPipe's default transport and channel hold io_urings,
    which CRIU cannot dump (the checkpoint was refused): a job's RPC defaults to TensorPipe's
    shared-memory transport (proxy/bootstrap/_singularity_proxy/stores.py)."""
    args = ["--steps", "40", "--sleep", "0.1"]
    preempted_job_prints_the_direct_output(daemon_root, "rpc_pipeline.py", args, (5, 15, 25), 120)


@requires_root
@pytest.mark.parametrize("owner", ["root", "another user"])
def test_shared_memory_files_travel_in_the_checkpoint(daemon_root: Path, owner: str) -> None:
    """A job whose spawned workers share a queue (its semaphores are files of /dev/shm, which CRIU
    expects at restore) is suspended; its files are then removed from /dev/shm, as on another
    machine, and the resume puts them back from the checkpoint, its user's: the job prints what a
    direct run prints (the restore failed for want of them before). Another user's files are
    read as that user (in a user namespace, their own mounts)."""
    args = ["--steps", "300", "--start", "spawn"]
    expected = direct_output("shared_device.py", args)
    release = daemon_root / "release"
    python, options, user = [PYTHON], JOB_OPTIONS, None
    if owner != "root":
        user = other_user()
        command = python_for_user(user)
        assert command is not None and command[1].startswith("PYTHONPATH=")
        python, options = [command[-1]], [*JOB_OPTIONS, "--env", command[1]]
    with running_daemon(daemon_root, virtual_devices=1) as daemon:
        job = daemon.submit(
            *python, "shared_device.py", *args, "--hold", str(release), options=options, user=user
        )
        wait_until(functools.partial(progressed, daemon, job, 20, 300), timeout=180)
        result = daemon.sing("suspend", str(job), user=user)
        assert result.code == 0, result.err
        (index,) = (daemon.state_dir / "checkpoints" / str(job)).glob("*/images/shm/files.json")
        carried = [Path("/dev/shm", entry["name"]) for entry in json.loads(index.read_text())]
        assert any(path.name.startswith("sem.mp-") for path in carried), carried
        owners = {path.stat().st_uid for path in carried}
        for path in carried:
            assert copy_path(index.parent.parent, path.name).read_bytes()  # the copy is there
            path.unlink()
        result = daemon.sing("resume", "--wait", str(job), timeout=120, user=user)
        assert result.code == 0, result.err
        assert {path.stat().st_uid for path in carried} == owners
        release.touch()
        assert daemon.sing("wait", str(job), timeout=600).code == 0, daemon.sing("logs", str(job)).out[-2000:]
        assert daemon.sing("logs", str(job)).out == expected


@requires_root
def test_a_job_cancelled_while_suspended_leaves_no_shared_memory_files(daemon_root: Path) -> None:
    """The /dev/shm files a suspended job's checkpoint carried have no process left to remove them
    once it is cancelled: they go with its checkpoints (they stayed in /dev/shm for good)."""
    args = ["--steps", "300", "--start", "spawn", "--hold", str(daemon_root / "never")]
    with running_daemon(daemon_root, virtual_devices=1) as daemon:
        job = daemon.submit(PYTHON, "shared_device.py", *args, options=JOB_OPTIONS)
        wait_until(functools.partial(progressed, daemon, job, 20, 300), timeout=180)
        assert daemon.sing("suspend", str(job)).code == 0
        (index,) = (daemon.state_dir / "checkpoints" / str(job)).glob("*/images/shm/files.json")
        carried = [Path("/dev/shm", entry["name"]) for entry in json.loads(index.read_text())]
        assert carried and all(path.exists() for path in carried)
        assert daemon.sing("cancel", str(job)).code == 0
        daemon.wait_state(job, "CANCELLED")
        wait_until(lambda: not any(path.exists() for path in carried), timeout=30)


@requires_root
def test_a_process_exiting_after_its_connection_ended_is_checkpointed(daemon_root: Path) -> None:
    """A spawned worker that used the device, caught at the very end of its exit (its client has
    ended the connection, the server has let its session go, the process still holds the dead
    socket): two checkpoints restore it as it was, no connection given back to it (the restore
    failed with "no session to resume"), and the job prints what a direct run prints."""
    ready = daemon_root / "direct"
    ready.mkdir()
    (ready / "go").touch()
    expected = direct_output("exiting_worker.py", [str(ready)])
    folder = daemon_root / "linger"
    folder.mkdir()
    with running_daemon(daemon_root, virtual_devices=1) as daemon:
        job = daemon.submit(PYTHON, "exiting_worker.py", str(folder), options=JOB_OPTIONS)
        wait_until((folder / "lingering").exists, timeout=180)
        for _ in range(2):
            result = daemon.sing("preempt", str(job))
            assert result.code == 0, result.err
            daemon.wait_state(job, "RUNNING")
        (folder / "go").touch()
        assert daemon.sing("wait", str(job), timeout=300).code == 0, daemon.sing("logs", str(job)).out[-2000:]
        assert daemon.sing("logs", str(job)).out == expected
        reasons = [e["reason"] for e in daemon.job(job)["events"]]
        assert sum(r.startswith("restored from checkpoint") for r in reasons) == 2


@requires_root
def test_another_users_proxied_job_preempted_is_exact(daemon_root: Path) -> None:
    """A second user's job holding connections to the proxy (external to its namespaces) is
    dumped, and restored with fresh connections, exactly; it runs in a user namespace where root
    lacks CAP_SYS_RESOURCE."""
    owner = other_user()
    python = python_for_user(owner)
    assert python is not None and python[1].startswith("PYTHONPATH=")
    total = 300
    args = ["--steps", str(total)]
    expected = direct_output("long_train.py", args)
    options = [*JOB_OPTIONS, "--env", python[1]]
    release = daemon_root / "release"
    with running_daemon(daemon_root, virtual_devices=1) as daemon:
        job = daemon.submit(
            python[-1], "long_train.py", *args, "--hold", str(release), options=options, user=owner
        )
        daemon.wait_state(job, "RUNNING")
        seen = 0
        for _ in range(2):
            wait_until(functools.partial(progressed, daemon, job, seen + 20, total), timeout=120)
            result = daemon.sing("preempt", str(job), user=owner)
            assert result.code == 0, result.err
            daemon.wait_state(job, "RUNNING")
            seen = steps(daemon, job)
        folders = (daemon.state_dir / "checkpoints" / str(job)).glob("*/manifest.json")
        manifests = [json.loads(path.read_text()) for path in folders]
        assert manifests and all(m["extra"]["proxy_connections"] for m in manifests)
        release.touch()
        assert daemon.sing("wait", str(job), timeout=600).code == 0
        assert daemon.sing("logs", str(job)).out == expected


def test_job_process_holds_no_device_state(daemon: Daemon) -> None:
    """No /dev/nvidia* and no CUDA library in the job, even after torch.cuda.init()."""
    job = daemon.submit(PYTHON, "probe_no_cuda.py", options=JOB_OPTIONS)
    assert daemon.sing("wait", str(job), timeout=300).code == 0, daemon.sing("logs", str(job)).out
    out = daemon.sing("logs", str(job)).out
    assert "available True count 1" in out and "value True" in out
    assert "nvidia fds []" in out and "cuda libraries []" in out
    assert "real lazy init ran False" in out


def test_a_virtual_devices_utilization_is_the_share_of_time_its_server_works(daemon: Daemon) -> None:
    """`sing devices` (and `sing top`, the metrics) show a virtual device's utilisation as nvtop shows
    a GPU's: the share of the last second its proxy server ran work; 0 for a device at rest."""
    job = daemon.submit(PYTHON, "utilization.py", "--forever", options=JOB_OPTIONS)
    device = daemon.wait_state(job, "RUNNING")["devices"][0]

    def working() -> list[dict[str, Any]]:
        listed = daemon.sing("devices", "-o", "json").json()
        return listed if (listed[device]["utilization_percent"] or 0) >= 30 else []

    listed = wait_until(working, timeout=120)
    assert listed[device]["utilization_percent"] <= 100
    assert all(d["utilization_percent"] == 0 for d in listed if d["index"] != device)
    rows = [line.split() for line in daemon.sing("devices").out.splitlines()[1:]]
    row = next(row for row in rows if row[0] == str(device))
    assert row[-2].endswith("%") and int(row[-2].removesuffix("%")) > 0, row
    assert daemon.sing("cancel", str(job)).code == 0


def server_of(daemon: Daemon, job: int) -> tuple[int, int]:
    """(pid, device) of the proxy server the daemon started for the job's first device."""
    device = daemon.job(job)["devices"][0]
    record = daemon.state_dir / "proxy" / "servers" / f"job-{job}-dev-{device}.json"
    return int(wait_until(record.exists) and json.loads(record.read_text())["pid"]), device


def status_of(pid: int) -> dict[str, str]:
    """/proc/PID/status as a dict of its fields."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def test_proxy_servers_survive_a_daemon_restart(daemon_root: Path) -> None:
    release = daemon_root / "release"
    expected = direct_output("long_train.py", ["--steps", "60"])
    with running_daemon(daemon_root, virtual_devices=1) as daemon:
        job = daemon.submit(
            PYTHON, "long_train.py", "--steps", "60", "--hold", str(release), options=JOB_OPTIONS
        )
        wait_until(functools.partial(progressed, daemon, job, 5, 60), timeout=120)
        pid, device = server_of(daemon, job)
        daemon.stop()
        assert os.path.exists(f"/proc/{pid}"), "the job's proxy outlives the daemon"
        daemon.start()
        assert (
            f"adopted the proxy server of job {job} on device {device} (pid {pid})" in daemon.log.read_text()
        )
        release.touch()
        assert daemon.sing("wait", str(job), timeout=300).code == 0
        assert daemon.sing("logs", str(job)).out == expected
        wait_until(functools.partial(ended, pid))


DEVICE_LOOP = """
import time, torch
x = torch.ones(4, device="cuda")
print("started", flush=True)
while True:
    x = x + 1
    x.sum().item()
    time.sleep(0.05)
"""


def test_a_job_whose_device_proxy_is_killed_fails_saying_so(daemon: Daemon) -> None:
    """The job failed with "exited with code 1" alone: its program's error when its proxy went away."""
    job = daemon.submit(PYTHON, "-c", DEVICE_LOOP, options=JOB_OPTIONS)
    wait_until(lambda: "started" in daemon.sing("logs", str(job)).out, timeout=120)
    pid, device = server_of(daemon, job)
    os.kill(pid, signal.SIGKILL)
    failed = daemon.wait_state(job, "FAILED", timeout=60)
    assert failed["events"][-1]["reason"] == (
        f"its device proxy (device {device}) was killed by SIGKILL, and the program exited with code 1"
    )


def ended(pid: int) -> bool:
    """Whether the process is gone (or a zombie: reaping orphans is init's business)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


ATTACK = """
import socket, sys
from _singularity_proxy import protocol
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
except OSError as error:
    print("connect:", error.strerror)
    sys.exit(0)
protocol.send_message(s, protocol.HELLO, [sys.argv[2], 0, 0, False])
print(protocol.recv_frame(s).value())
"""


@requires_root
def test_job_device_work_runs_with_the_users_privileges_only(daemon: Daemon) -> None:
    """The server of a job runs as its user, holds no capability, and only that user reaches it."""
    alice = ensure_user("sing-alice")
    ensure_user("sing-bob")
    job = daemon.submit("sleep", "300", user="sing-alice")
    daemon.wait_state(job, "RUNNING")
    pid, device = server_of(daemon, job)
    fields = status_of(pid)
    assert fields["Uid"].split() == [str(alice.pw_uid)] * 4
    assert fields["Gid"].split() == [str(alice.pw_gid)] * 4
    for capability_set in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[capability_set], 16) == 0, capability_set
    assert fields["NoNewPrivs"] == "1"
    assert os.stat(f"/proc/{pid}/fd").st_uid == 0, "not dumpable: the user cannot trace it"
    socket_path = daemon.root / "run" / "proxy" / f"job-{job}" / f"dev-{device}.sock"
    assert os.stat(socket_path).st_uid == alice.pw_uid and os.stat(socket_path).st_mode & 0o777 == 0o600
    bootstrap = daemon.state_dir / "bootstrap"

    def hello_as(user: str, job_id: str) -> str:
        done = subprocess.run(
            ["/usr/bin/python3", "-c", ATTACK, str(socket_path), job_id],
            env={"PYTHONPATH": str(bootstrap), "PATH": "/usr/bin:/bin"},
            user=user, capture_output=True, text=True, timeout=120, cwd="/tmp",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert hello_as("sing-bob", str(job)).strip() == "connect: Permission denied"
    assert f"serves job {job}, not '4242'" in hello_as("sing-alice", "4242")
    assert daemon.sing("cancel", str(job)).code == 0
    daemon.wait_state(job, "CANCELLED")
    wait_until(functools.partial(ended, pid))
    assert not socket_path.parent.exists(), "the job's sockets and temporary files are gone with it"


@requires_root
def test_devices_show_proxy_sessions_and_jobs_their_last_checkpoint(daemon_root: Path) -> None:
    """What `sing top` shows: a started proxy with each rank's session, the newest checkpoint and
    the pause it cost the job."""
    release = daemon_root / "release"
    with running_daemon(daemon_root, virtual_devices=2) as daemon:
        args = ["--steps", "10", "--hold", str(release)]
        job = daemon.submit(PYTHON, "long_train.py", *args, options=JOB_OPTIONS)
        device = daemon.wait_state(job, "RUNNING")["devices"][0]
        wait_until(functools.partial(progressed, daemon, job, 9, 10), timeout=120)

        listed = {d["index"]: d for d in daemon.sing("devices", "-o", "json").json()}
        used, unused = listed[device], listed[1 - device]
        assert used["proxy"] == "up" and used["jobs"] == [job]
        assert [(s["job"], s["rank"], s["connected"]) for s in used["sessions"]] == [(job, 0, True)]
        assert used["memory_used"] == used["sessions"][0]["bytes"] > 0, "a virtual device's use is its jobs'"
        assert unused["proxy"] == "idle" and unused["sessions"] == [] and unused["memory_used"] == 0

        assert daemon.job(job)["last_checkpoint"] is None
        taken = daemon.sing("checkpoint", "-o", "json", str(job)).json()
        assert taken.pop("job") == job and taken["complete"] and taken["pause_seconds"] > 0
        assert daemon.job(job)["last_checkpoint"] == taken, "the pause measured when taken is kept"
        assert daemon.job(job)["checkpoint_list"][-1] == taken
        release.touch()
        assert daemon.sing("wait", str(job), timeout=300).code == 0


@requires_root
def test_the_first_kernel_after_a_restore_computes_what_it_computes_undisturbed(daemon_root: Path) -> None:
    """A job preempted while it waits runs a matrix product first on its restored proxy server:
    the product has the bytes it has undisturbed. (A server's new session thread ran its first
    kernels with OpenMP's default thread count, the machine's cores, instead of the server's
    one until some kernel asked torch for it: on a machine of 2 cores or more the product's low
    bits differed.)"""
    release = daemon_root / "release"
    with running_daemon(daemon_root, virtual_devices=1) as daemon:
        undisturbed = daemon.submit(PYTHON, "first_kernel.py", options=JOB_OPTIONS)
        assert daemon.sing("wait", str(undisturbed), timeout=300).code == 0
        expected = daemon.sing("logs", str(undisturbed)).out
        assert "product " in expected, expected
        job = daemon.submit(PYTHON, "first_kernel.py", "--hold", str(release), options=JOB_OPTIONS)
        wait_until(lambda: "ready" in daemon.sing("logs", str(job)).out, timeout=300)
        assert daemon.sing("preempt", str(job)).code == 0
        daemon.wait_state(job, "RUNNING")
        release.touch()
        assert daemon.sing("wait", str(job), timeout=300).code == 0
        assert daemon.sing("logs", str(job)).out == expected


@requires_root
def test_a_data_parallel_job_preempted_and_moved_runs_as_if_never_stopped(daemon_root: Path) -> None:
    """`nn.DataParallel` over a job's 2 devices (each host batch scattered, the model replicated to
    the second device every step and run there in a thread, gradients summed on the first,
    BatchNorm statistics kept on the first): preempted, then moved to the other 2 devices, once
    its training is done and before it reads its weights, it prints what an undisturbed run does."""
    total = 40
    args = ["data_parallel_train.py", "--steps", str(total)]
    release = daemon_root / "release"
    options = [*JOB_OPTIONS, "--gpus", "2"]
    with running_daemon(daemon_root, virtual_devices=4) as daemon:
        undisturbed = daemon.submit(PYTHON, *args, options=options)
        assert daemon.sing("wait", str(undisturbed), timeout=600).code == 0
        expected = daemon.sing("logs", str(undisturbed)).out
        assert expected.startswith("devices 2\n") and f"step {total - 1} " in expected, expected[-2000:]
        job = daemon.submit(PYTHON, *args, options=[*options, "--env", f"CORPUS_HOLD={release}"])
        first = daemon.wait_state(job, "RUNNING")["devices"]
        wait_until(lambda: steps(daemon, job) == total, timeout=300)
        assert daemon.sing("preempt", str(job)).code == 0
        daemon.wait_state(job, "RUNNING")
        assert daemon.sing("suspend", str(job)).code == 0
        blocker = daemon.submit("sleep", "300", options=["--gpus", "2"])
        assert daemon.wait_state(blocker, "RUNNING")["devices"] == first
        assert daemon.sing("resume", str(job)).code == 0
        assert not set(daemon.wait_state(job, "RUNNING")["devices"]) & set(first), "moved"
        release.touch()
        assert daemon.sing("wait", str(job), timeout=600).code == 0, daemon.sing("logs", str(job)).out[-2000:]
        assert daemon.sing("logs", str(job)).out == expected
        daemon.sing("cancel", str(blocker))
