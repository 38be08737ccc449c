"""Unmodified `cuda` programs under the real daemon: proxied virtual devices, preempted and moved.

The corpus runs through `sing submit` on virtual devices (served by socket-activated proxy
servers the daemon owns) and must print exactly what it prints run directly on the CPU; a
proxied job preempted at random moments, and resumed on another device, must too.
"""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import time
from pathlib import Path

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
    started = [p for p in (daemon.state_dir / "proxy").glob("dev-*.pid")]
    assert started, "the daemon started proxy servers for the jobs"


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
        release.touch()
        assert daemon.sing("wait", str(job), timeout=600).code == 0
        assert daemon.sing("logs", str(job)).out == expected
        folders = (daemon.state_dir / "checkpoints" / str(job)).glob("*/manifest.json")
        manifests = [json.loads(path.read_text()) for path in folders]
        assert manifests and all(m["extra"]["proxy_connections"] for m in manifests)


def test_job_process_holds_no_device_state(daemon: Daemon) -> None:
    """No /dev/nvidia* and no CUDA library in the job, even after torch.cuda.init()."""
    job = daemon.submit(PYTHON, "probe_no_cuda.py", options=JOB_OPTIONS)
    assert daemon.sing("wait", str(job), timeout=300).code == 0, daemon.sing("logs", str(job)).out
    out = daemon.sing("logs", str(job)).out
    assert "available True count 1" in out and "value True" in out
    assert "nvidia fds []" in out and "cuda libraries []" in out
    assert "real lazy init ran False" in out


def test_proxy_servers_survive_a_daemon_restart(daemon_root: Path) -> None:
    with running_daemon(daemon_root, virtual_devices=1) as daemon:
        job = daemon.submit(PYTHON, "mlp.py", options=JOB_OPTIONS)
        assert daemon.sing("wait", str(job), timeout=300).code == 0
        pid = int((daemon.state_dir / "proxy" / "dev-0.pid").read_text())
        daemon.stop()
        assert os.path.exists(f"/proc/{pid}"), "the proxy outlives the daemon"
        daemon.start()
        again = daemon.submit(PYTHON, "mlp.py", options=JOB_OPTIONS)
        assert daemon.sing("wait", str(again), timeout=300).code == 0
        assert int((daemon.state_dir / "proxy" / "dev-0.pid").read_text()) == pid, "adopted, not restarted"
        assert "adopted the proxy server of device 0" in daemon.log.read_text()


ATTACK = """
import socket, sys
from _singularity_proxy import protocol
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
protocol.send_message(s, protocol.HELLO, [sys.argv[2], 0, 0, False])
print(protocol.recv_frame(s).value())
"""


@requires_root
def test_users_cannot_open_sessions_for_jobs_not_theirs(daemon: Daemon) -> None:
    """A proxy session of a job can be opened only by the job's own user (or root)."""
    ensure_user("sing-alice")
    bob = ensure_user("sing-bob")
    job = daemon.submit("sleep", "300", user="sing-alice")
    daemon.wait_state(job, "RUNNING")
    device = daemon.job(job)["devices"][0]
    socket_path = daemon.root / "run" / "proxy" / f"dev-{device}.sock"
    bootstrap = daemon.state_dir / "bootstrap"

    def hello_as(user: str, job_id: str, path: Path = socket_path) -> str:
        done = subprocess.run(
            ["/usr/bin/python3", "-c", ATTACK, str(path), job_id],
            env={"PYTHONPATH": str(bootstrap), "PATH": "/usr/bin:/bin"},
            user=user, capture_output=True, text=True, timeout=120, cwd="/tmp",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert f"job {job} does not belong to uid {bob.pw_uid}" in hello_as("sing-bob", str(job))
    assert "job 4242 is not admitted on this device" in hello_as("sing-bob", "4242")
    other = socket_path.with_name(f"dev-{(device + 1) % 4}.sock")
    assert f"job {job} was not granted device {(device + 1) % 4}" in hello_as("sing-alice", str(job), other)
    daemon.sing("cancel", str(job))
