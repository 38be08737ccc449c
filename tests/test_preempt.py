"""Transparent preemption through the daemon: real CRIU dumps and restores of real PyTorch jobs.

The proof is bitwise: the job's output (every step's loss and the final weight checksum) under
preemption, suspension, in-place checkpoints, crashes and corrupt images equals the output of the
same unmodified script run once without interruption. A job that must still be running when an
operation hits it holds before its checksum until the test creates its release file.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from singularityd.checkpoint.namespaces import user_namespace_of
from singularityd.checkpoint.precheck import CAP_SYS_RESOURCE, have_capability
from singularityd.jobs.launch import WITHOUT_AMX, cpu_has_amx
from tests.conftest import requires_root
from tests.helpers import (
    OWNER,
    REPO,
    Daemon,
    ensure_user,
    other_user,
    python_for_user,
    running_daemon,
    submit_counter,
    user_namespace_problem,
    wait_until,
)
from tests.proxy.conftest import communicate_all, start_ranks

pytestmark = [requires_root, pytest.mark.slow]

SCRIPT = REPO / "tests" / "workloads" / "train_cpu.py"
STEPS = 300
JOB_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def train_command(
    steps: int = STEPS, sleep: float = 0.01, user: str | None = None, bf16: bool = False
) -> list[str]:
    """The training script's command line (computing in bfloat16 with `bf16`); for another user, a
    Python that user may run."""
    python = [sys.executable] if user is None else python_for_user(user)
    if python is None:
        pytest.skip(f"no Python with this project importable by {user} here")
    return [*python, str(SCRIPT), "--steps", str(steps), "--sleep", str(sleep), *(["--bf16"] if bf16 else [])]


@functools.cache
def uninterrupted_output(steps: int = STEPS, bf16: bool = False) -> str:
    """The script's stdout when run directly, once, without singularityd (with the instruction sets
    the daemon gives jobs on this CPU: launch.WITHOUT_AMX)."""
    env = {**os.environ, **JOB_ENV, **(WITHOUT_AMX if cpu_has_amx() else {})}
    command = train_command(steps, 0.0, bf16=bf16)
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    return done.stdout


def release_file(daemon: Daemon) -> Path:
    """The file whose creation lets held jobs finish (in a folder every job's user can read)."""
    return daemon.root / "release"


def submit_training(
    daemon: Daemon,
    *options: str,
    steps: int = STEPS,
    user: str | None = None,
    sleep: float = 0.01,
    hold: Path | None = None,
    bf16: bool = False,
) -> int:
    """Submit the training script (as `user`); with `hold` it cannot end before that file exists."""
    env_options = [f"--env={key}={value}" for key, value in JOB_ENV.items()]
    command = train_command(steps, sleep, user=user, bf16=bf16) + (["--hold", str(hold)] if hold else [])
    return daemon.submit(*command, options=[*env_options, *options], user=user)


def assert_runs_as_owner(daemon: Daemon, job_id: int) -> None:
    """The job's ranks run as OWNER with no capabilities; where root lacks CAP_SYS_RESOURCE, its
    init is root of an identity-mapped user namespace the daemon created."""
    init, ranks = wait_until(lambda: supervisor_and_ranks(daemon, job_id))
    for rank in ranks:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{rank}/status").read_text().splitlines())
        assert status["Uid"].split() == [str(ensure_user(OWNER).pw_uid)] * 4
        assert status["CapEff"].strip() == "0000000000000000"
    namespace = user_namespace_of(init)
    if user_namespace_problem() is None:
        assert namespace.ours
        return
    assert not namespace.ours and namespace.owned_by_us
    assert Path(f"/proc/{init}/uid_map").read_text().split() == ["0", "0", "4294967295"]
    assert Path(f"/proc/{init}/gid_map").read_text().split() == ["0", "0", "4294967295"]
    assert all(user_namespace_of(rank).inode == namespace.inode for rank in ranks)


def steps_done(daemon: Daemon, job_id: int) -> int:
    """How many steps rank 0 has printed."""
    log = daemon.state_dir / "jobs" / str(job_id) / "logs" / "rank-0.log"
    try:
        return log.read_text().count("step ")
    except FileNotFoundError:
        return 0


def wait_progress(daemon: Daemon, job_id: int, beyond: int, steps: int = STEPS) -> int:
    """Wait until the job has printed more than `beyond` steps (or all of them, when it holds at
    the end); return how many it has."""
    target = min(beyond, steps - 1)
    return int(wait_until(lambda: (n := steps_done(daemon, job_id)) > target and n, timeout=60))


def events(daemon: Daemon, job_id: int) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = daemon.job(job_id)["events"]
    return found


@pytest.fixture
def cr_daemon(daemon_root: Path) -> Iterator[Daemon]:
    """A daemon with working checkpoints (fails clearly when CRIU is missing)."""
    with running_daemon(daemon_root, virtual_devices=2, config={"checkpoint_keep": 3}) as daemon:
        info = daemon.sing("doctor")
        if "checkpoints unavailable" in info.out:
            pytest.fail(f"CRIU must work for these tests (run scripts/setup):\n{info.out}")
        yield daemon


def test_preempt_resume_and_checkpoint_are_bitwise_exact(cr_daemon: Daemon) -> None:
    expected = uninterrupted_output()
    rng = random.Random(20261129)
    operations = ["preempt"] * 5 + ["checkpoint"] * 3
    rng.shuffle(operations)
    release = release_file(cr_daemon)
    job = submit_training(cr_daemon, hold=release)
    cr_daemon.wait_state(job, "RUNNING")
    progress = 0
    for operation in operations:
        progress = wait_progress(cr_daemon, job, progress + rng.randint(1, 15))
        time.sleep(rng.uniform(0.0, 0.05))
        result = cr_daemon.sing(operation, str(job))
        assert result.code == 0, result.err
        if operation == "checkpoint":
            assert result.out.startswith(f"job {job}: checkpoint ")
        else:
            cr_daemon.wait_state(job, "RUNNING")
    preempts = operations.count("preempt")
    shown = cr_daemon.job(job)
    assert shown["checkpoints"] == 3 and shown["checkpoint_bytes"] > 0, "keeps the last 3 (checkpoint_keep)"
    release.touch()
    cr_daemon.wait_ok(job, timeout=300)
    assert cr_daemon.sing("logs", str(job)).out == expected
    reasons = [e["reason"] for e in events(cr_daemon, job)]
    assert sum(r.startswith("preempted by root: checkpoint") for r in reasons) == preempts
    assert sum(r.startswith("restored from checkpoint") for r in reasons) == preempts
    removed = wait_until(
        lambda: [e["reason"] for e in events(cr_daemon, job) if "checkpoints were removed" in e["reason"]],
        timeout=60,
    )
    assert removed[0].startswith("its checkpoints were removed (")
    assert cr_daemon.job(job)["checkpoints"] == 0, "an ended job never resumes: its images go"
    assert not [p for p in (cr_daemon.state_dir / "checkpoints" / str(job)).iterdir() if p.name[0].isdigit()]


def test_a_job_computing_in_bfloat16_is_preempted_and_resumed_exactly(cr_daemon: Daemon) -> None:
    """bfloat16 matrix products on the CPU (oneDNN uses AMX where the CPU has it). CRIU does not
    restore a process's AMX permission, so a job that used AMX would die of SIGILL after its
    restore: the daemon caps oneDNN and MKL below AMX in jobs on such a CPU (WITHOUT_AMX), and the
    job's output equals a direct run with those caps."""
    steps = 120
    direct = uninterrupted_output(steps, bf16=True)
    assert direct != uninterrupted_output(steps), "bfloat16 changes the losses"
    job = submit_training(cr_daemon, steps=steps, hold=release_file(cr_daemon), bf16=True)
    cr_daemon.wait_state(job, "RUNNING")

    def progressed_or_failed(beyond: int) -> bool:
        return steps_done(cr_daemon, job) > beyond or cr_daemon.job(job)["state"] == "FAILED"

    for beyond in (10, 40):
        wait_until(functools.partial(progressed_or_failed, beyond), 60)
        shown = cr_daemon.job(job)
        assert shown["state"] == "RUNNING", shown["reason"]
        result = cr_daemon.sing("preempt", str(job), timeout=300)
        assert result.code == 0, result.err
        cr_daemon.wait_state(job, "RUNNING", timeout=120)
    release_file(cr_daemon).touch()
    cr_daemon.wait_ok(job, timeout=300)
    assert cr_daemon.sing("logs", str(job)).out == direct
    reasons = [e["reason"] for e in events(cr_daemon, job)]
    assert sum(r.startswith("restored from checkpoint") for r in reasons) == 2, reasons


def test_suspend_hold_and_resume(cr_daemon: Daemon) -> None:
    release = release_file(cr_daemon)
    job = submit_training(cr_daemon, steps=120, hold=release)
    cr_daemon.wait_state(job, "RUNNING")
    wait_progress(cr_daemon, job, 10, steps=120)
    assert cr_daemon.sing("suspend", str(job)).code == 0
    held = cr_daemon.job(job)
    assert held["state"] == "SUSPENDED" and held["devices"] == []
    assert held["reason"].endswith("held until resumed")
    frozen = steps_done(cr_daemon, job)
    time.sleep(1.0)
    assert steps_done(cr_daemon, job) == frozen and cr_daemon.job(job)["state"] == "SUSPENDED"
    again = cr_daemon.sing("resume", str(job))
    assert again.code == 0, again.err
    release.touch()
    cr_daemon.wait_ok(job, timeout=300)
    assert cr_daemon.sing("logs", str(job)).out == uninterrupted_output(120)


def test_daemon_and_job_killed_resume_from_periodic_checkpoint(daemon_root: Path) -> None:
    expected = uninterrupted_output(200)
    with running_daemon(daemon_root, virtual_devices=1) as daemon:
        release = release_file(daemon)
        job = submit_training(daemon, "--checkpoint-every", "1.5", steps=200, hold=release)
        daemon.wait_state(job, "RUNNING")
        wait_progress(daemon, job, 0, steps=200)
        taken = periodic_checkpoints(daemon, job)
        wait_until(lambda: periodic_checkpoints(daemon, job) >= max(2, taken + 1), timeout=120)
        supervisor = daemon.supervisor_pid(job)
        daemon.stop(signal.SIGKILL)
        os.kill(supervisor, signal.SIGKILL)  # PID 1 of the job's namespace: every rank dies with it
        wait_until(lambda: process_gone(supervisor), timeout=60)
        daemon.start()
        lost = daemon.wait_state(job, "RUNNING", "PREEMPTED", timeout=60)
        assert lost["state"] != "FAILED"
        release.touch()
        daemon.wait_ok(job, timeout=300)
        reasons = [e["reason"] for e in events(daemon, job)]
        assert any("queued to resume from its last checkpoint" in r for r in reasons), reasons
        assert daemon.sing("logs", str(job)).out == expected, "logs rewound to the checkpoint, then replayed"


def periodic_checkpoints(daemon: Daemon, job_id: int) -> int:
    """How many periodic checkpoints of the job its events record."""
    return sum("periodic checkpoint" in e["reason"] for e in events(daemon, job_id))


def process_gone(pid: int) -> bool:
    """Whether the process has exited (a zombie not yet reaped counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def newest_checkpoint(daemon: Daemon, job_id: int) -> Path:
    folders = [p for p in (daemon.state_dir / "checkpoints" / str(job_id)).iterdir() if p.name[0].isdigit()]
    return max(folders, key=lambda p: int(p.name.split("-")[0]))


def test_a_restore_refused_for_a_cause_outside_the_job_holds_it_with_its_checkpoints(
    cr_daemon: Daemon,
) -> None:
    """A job listening on a port was suspended and the port taken meanwhile: CRIU refuses the
    restore. The job failed and its checkpoints were deleted; it is held with them, and resumes
    exactly once the port is free again."""
    release = release_file(cr_daemon)
    listen = (
        "import socket\n"
        "listener = socket.socket()\n"
        "listener.bind(('127.0.0.1', 0))\n"
        "listener.listen(1)\n"
        "print('port', listener.getsockname()[1], flush=True)\n"
    )
    job = submit_counter(cr_daemon, release, first=listen)
    printed = wait_until(lambda: (out := cr_daemon.sing("logs", str(job)).out).count("\n") > 5 and out)
    port = int(printed.splitlines()[0].split()[1])
    assert cr_daemon.sing("suspend", str(job)).code == 0
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen(1)
        waited = cr_daemon.sing("resume", "--wait", str(job), timeout=120)  # it waited for ever
        assert waited.code != 0 and waited.err.startswith(f"sing: job {job} did not run again: cannot resume")
        held = wait_until(lambda: (j := cr_daemon.job(job))["reason"].startswith("cannot resume") and j)
    assert held["state"] == "SUSPENDED" and held["devices"] == [], held
    assert "held with its checkpoints" in held["reason"], held["reason"]
    assert held["checkpoint_list"], "the checkpoint is kept"
    again = cr_daemon.sing("resume", str(job))
    assert again.code == 0, again.err
    wait_until(lambda: cr_daemon.sing("logs", str(job)).out.count("\n") > len(printed.splitlines()) + 5)
    release.touch()
    cr_daemon.wait_ok(job, timeout=300)
    lines = cr_daemon.sing("logs", str(job)).out.splitlines()
    assert lines[0] == f"port {port}" and lines[-1] == "end"
    assert lines[1:-1] == [str(i) for i in range(len(lines) - 2)], "every count printed once, in order"


def test_corrupt_newest_image_falls_back_to_previous(cr_daemon: Daemon) -> None:
    release = release_file(cr_daemon)
    job = submit_training(cr_daemon, steps=150, hold=release)
    cr_daemon.wait_state(job, "RUNNING")
    wait_progress(cr_daemon, job, 20, steps=150)
    assert cr_daemon.sing("checkpoint", str(job)).code == 0
    wait_progress(cr_daemon, job, steps_done(cr_daemon, job) + 10, steps=150)
    assert cr_daemon.sing("suspend", str(job)).code == 0
    newest = newest_checkpoint(cr_daemon, job)
    pages = max((p for p in newest.rglob("pages-*.img")), key=lambda p: p.stat().st_size)
    with pages.open("r+b") as handle:
        handle.seek(pages.stat().st_size // 2)
        handle.write(b"\xff\x00\xff\x00 corrupt")
    assert cr_daemon.sing("resume", str(job)).code == 0
    release.touch()
    cr_daemon.wait_ok(job, timeout=300)
    reasons = [e["reason"] for e in events(cr_daemon, job)]
    skipped = [r for r in reasons if r.startswith("checkpoint ") and " not used: " in r]
    assert skipped, reasons
    assert "sha256" in skipped[0] or "checksum" in skipped[0] or "digest" in skipped[0], skipped[0]
    assert any(r.startswith("restored from checkpoint") for r in reasons)
    assert cr_daemon.sing("logs", str(job)).out == uninterrupted_output(150)


def test_images_are_private_to_the_job_owner(cr_daemon: Daemon) -> None:
    """Images hold process memory: owned by the job's user, mode 0700, unreadable by others."""
    ensure_user("sing-bob")
    owner = other_user()
    owner_uid = ensure_user(owner).pw_uid
    job = cr_daemon.submit("sh", "-c", "while true; do sleep 0.1; done", user=owner)
    cr_daemon.wait_state(job, "RUNNING")
    wait_until(lambda: (cr_daemon.state_dir / "jobs" / str(job) / "init.pid").exists())
    time.sleep(0.3)
    result = cr_daemon.sing("checkpoint", str(job), user=owner)
    assert result.code == 0, result.err
    newest = newest_checkpoint(cr_daemon, job)
    assert newest.stat().st_uid == owner_uid
    assert stat.S_IMODE(newest.stat().st_mode) == 0o700
    image = next(newest.rglob("pages-*.img"))
    as_bob = subprocess.run(["cat", str(image)], user="sing-bob", capture_output=True, cwd="/tmp", timeout=30)
    assert as_bob.returncode != 0 and b"Permission denied" in as_bob.stderr
    listing = subprocess.run(
        ["ls", str(newest)], user="sing-bob", capture_output=True, cwd="/tmp", timeout=30
    )
    assert listing.returncode != 0
    mine = subprocess.run(["head", "-c", "1", str(image)], user=owner, capture_output=True, cwd="/tmp")
    assert mine.returncode == 0
    cr_daemon.sing("cancel", str(job))


def test_another_users_job_preempted_and_resumed_exactly(cr_daemon: Daemon) -> None:
    """A second user's PyTorch job: preempted, checkpointed in place, preempted again, by its owner."""
    owner = other_user()
    release = release_file(cr_daemon)
    job = submit_training(cr_daemon, user=owner, steps=200, sleep=0.05, hold=release)
    cr_daemon.wait_state(job, "RUNNING")
    progress = wait_progress(cr_daemon, job, 5, steps=200)
    assert_runs_as_owner(cr_daemon, job)
    for operation in ("preempt", "checkpoint", "preempt"):
        progress = wait_progress(cr_daemon, job, progress + 5, steps=200)
        result = cr_daemon.sing(operation, str(job), user=owner)
        assert result.code == 0, result.err
        cr_daemon.wait_state(job, "RUNNING")
        assert_runs_as_owner(cr_daemon, job)
    release.touch()
    cr_daemon.wait_ok(job, timeout=300)
    assert cr_daemon.sing("logs", str(job), user=owner).out == uninterrupted_output(200)
    reasons = [e["reason"] for e in events(cr_daemon, job)]
    assert sum(r.startswith(f"preempted by {owner}: checkpoint") for r in reasons) == 2, reasons


def test_another_users_job_suspended_and_resumed(cr_daemon: Daemon) -> None:
    owner = other_user()
    release = release_file(cr_daemon)
    job = submit_training(cr_daemon, user=owner, steps=120, hold=release)
    cr_daemon.wait_state(job, "RUNNING")
    wait_progress(cr_daemon, job, 10, steps=120)
    assert cr_daemon.sing("suspend", str(job), user=owner).code == 0
    assert cr_daemon.job(job)["state"] == "SUSPENDED"
    frozen = steps_done(cr_daemon, job)
    time.sleep(1.0)
    assert steps_done(cr_daemon, job) == frozen
    again = cr_daemon.sing("resume", str(job), user=owner)
    assert again.code == 0, again.err
    cr_daemon.wait_state(job, "RUNNING")
    release.touch()
    cr_daemon.wait_ok(job, timeout=300)
    assert cr_daemon.sing("logs", str(job)).out == uninterrupted_output(120)


def test_other_users_jobs_refused_with_the_reason_without_user_namespaces(daemon_root: Path) -> None:
    """Where root lacks CAP_SYS_RESOURCE and jobs get no user namespace, the refusal says why."""
    if have_capability(CAP_SYS_RESOURCE):
        pytest.skip("root holds CAP_SYS_RESOURCE here: other users' jobs need no user namespace")
    owner = ensure_user(OWNER).pw_name
    with running_daemon(daemon_root, config={"job_user_namespaces": False}) as daemon:
        job = daemon.submit("sh", "-c", "while true; do sleep 0.1; done", user=owner)
        daemon.wait_state(job, "RUNNING")
        wait_until(lambda: (daemon.state_dir / "jobs" / str(job) / "init.pid").exists())
        assert user_namespace_of(daemon.supervisor_pid(job)).ours
        refused = daemon.sing("preempt", str(job), user=owner)
        assert refused.code != 0
        assert "CAP_SYS_RESOURCE" in refused.err and "job_user_namespaces is off" in refused.err
        assert len(refused.err.strip().splitlines()) == 1
        assert daemon.job(job)["state"] == "RUNNING"
        daemon.sing("cancel", str(job))
        daemon.wait_state(job, "CANCELLED")


def supervisor_and_ranks(daemon: Daemon, job_id: int) -> tuple[int, list[int]] | None:
    """The host PIDs of the job's running supervisor and of its ranks, once all are there."""
    try:
        init = daemon.supervisor_pid(job_id)
        ranks = [int(p) for p in Path(f"/proc/{init}/task/{init}/children").read_text().split()]
    except (OSError, ValueError, IndexError):
        return None
    return (init, ranks) if ranks and not process_gone(init) else None


def test_bad_checkpoint_requests(cr_daemon: Daemon) -> None:
    blocker = cr_daemon.submit("sleep", "300", options=["--gpus", "2"])
    cr_daemon.wait_state(blocker, "RUNNING")
    queued = cr_daemon.submit("true")
    for verb in ("preempt", "checkpoint"):
        result = cr_daemon.sing(verb, str(queued))
        assert result.code == 6, result.err
        assert result.err.strip().startswith(f"sing: job {queued} is PENDING; only a RUNNING job can be")
    resumed = cr_daemon.sing("resume", str(blocker))
    assert resumed.code == 6 and "only a SUSPENDED job can be resumed" in resumed.err
    assert cr_daemon.sing("preempt", "999").code == 4
    cr_daemon.sing("cancel", str(blocker), str(queued))
    ended = cr_daemon.wait_state(blocker, "CANCELLED")
    result = cr_daemon.sing("preempt", str(ended["id"]))
    assert result.code == 6 and "is CANCELLED" in result.err


def test_checkpoint_on_a_full_disk_keeps_job_and_previous_images(daemon_root: Path) -> None:
    mount = daemon_root / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], check=True)
    try:
        config = {"checkpoint_dir": str(mount), "checkpoint_pre_copy": 0}
        with running_daemon(daemon_root, config=config) as daemon:
            script = "\n".join(
                [
                    "import time",
                    "x = bytearray(12 * 2**20)",
                    "while True:",
                    "    print(1, flush=True)",
                    "    time.sleep(0.2)",
                ]
            )
            job = daemon.submit(sys.executable, "-c", script)
            daemon.wait_state(job, "RUNNING")
            wait_until(lambda: steps_done_lines(daemon, job) > 1)
            first = daemon.sing("checkpoint", str(job))
            assert first.code == 0, first.err
            filler = mount / "filler"
            subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M", "count=80"], capture_output=True)
            second = daemon.sing("checkpoint", str(job))
            assert second.code == 6
            assert "No space left" in second.err or "space" in second.err, second.err
            assert len(second.err.strip().splitlines()) == 1 and "Traceback" not in second.err
            shown = daemon.job(job)
            assert shown["state"] == "RUNNING" and shown["checkpoints"] == 1
            assert any("checkpoint failed, the job keeps running" in e["reason"] for e in shown["events"])
            lines = steps_done_lines(daemon, job)
            wait_until(lambda: steps_done_lines(daemon, job) > lines)
            filler.unlink()
            assert daemon.sing("preempt", str(job)).code == 0
            daemon.wait_state(job, "RUNNING")
            daemon.sing("cancel", str(job))
            daemon.wait_state(job, "CANCELLED")
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def steps_done_lines(daemon: Daemon, job_id: int) -> int:
    log = daemon.state_dir / "jobs" / str(job_id) / "logs" / "rank-0.log"
    return log.read_text().count("\n") if log.exists() else 0


DDP_SCRIPT = REPO / "tests" / "workloads" / "train_ddp.py"


def direct_ddp_outputs(steps: int) -> list[str]:
    """Both ranks' stdout when the script runs directly, torchrun-style, without singularityd."""
    ranks = start_ranks([str(DDP_SCRIPT), "--steps", str(steps)], 2, None, **JOB_ENV)
    outputs = communicate_all(ranks, 300)
    assert all(process.returncode == 0 for process in ranks), [err[-2000:] for _, err in outputs]
    return [out for out, _ in outputs]


def test_two_rank_job_preempted_and_restored_exactly(cr_daemon: Daemon) -> None:
    """All ranks are dumped at once, TCP connections between them included, and resume exactly."""
    steps = 120
    expected = direct_ddp_outputs(steps)
    env_options = [f"--env={key}={value}" for key, value in JOB_ENV.items()]
    release = release_file(cr_daemon)
    command = [
        sys.executable,
        str(DDP_SCRIPT),
        "--steps",
        str(steps),
        "--sleep",
        "0.02",
        "--hold",
        str(release),
    ]
    job = cr_daemon.submit(*command, options=[*env_options, "--ranks", "2"])
    cr_daemon.wait_state(job, "RUNNING")
    progress = 0
    for _ in range(2):
        progress = wait_progress(cr_daemon, job, progress + 10, steps=steps)
        result = cr_daemon.sing("preempt", str(job))
        assert result.code == 0, result.err
        cr_daemon.wait_state(job, "RUNNING")
    release.touch()
    cr_daemon.wait_ok(job, timeout=300)
    outputs = [cr_daemon.sing("logs", "--rank", str(rank), str(job)).out for rank in range(2)]
    assert outputs == expected


def test_a_client_giving_up_does_not_strand_the_checkpoint(cr_daemon: Daemon) -> None:
    """A `sing preempt` killed while the checkpoint runs: the daemon still finishes it properly."""
    release = release_file(cr_daemon)
    job = submit_training(cr_daemon, steps=150, hold=release)
    cr_daemon.wait_state(job, "RUNNING")
    wait_progress(cr_daemon, job, 10, steps=150)
    env = {**os.environ, "SING_SOCKET": str(cr_daemon.socket)}
    impatient = subprocess.Popen([sys.executable, "-m", "singularity.cli.main", "preempt", str(job)], env=env)
    wait_until(lambda: any("preempt requested" in e["reason"] for e in events(cr_daemon, job)), timeout=60)
    impatient.kill()
    impatient.wait(10)
    wait_until(lambda: any(e["to_state"] == "PREEMPTED" for e in events(cr_daemon, job)), timeout=60)
    cr_daemon.wait_state(job, "RUNNING")
    again = cr_daemon.sing("checkpoint", str(job))
    assert again.code == 0, again.err
    release.touch()
    cr_daemon.wait_ok(job, timeout=300)
    assert cr_daemon.sing("logs", str(job)).out == uninterrupted_output(150)


def test_another_users_two_rank_job_in_a_private_network(daemon_root: Path) -> None:
    """With job_network = "private" the TCP connections between a second user's ranks are
    checkpointed too (in the host's network a job's user namespace could not restore them)."""
    owner = other_user()
    steps = 100
    expected = direct_ddp_outputs(steps)
    python = python_for_user(owner)
    assert python is not None
    env_options = [f"--env={key}={value}" for key, value in JOB_ENV.items()]
    with running_daemon(daemon_root, virtual_devices=2, config={"job_network": "private"}) as daemon:
        release = release_file(daemon)
        command = [*python, str(DDP_SCRIPT), "--steps", str(steps), "--sleep", "0.02", "--hold", str(release)]
        job = daemon.submit(*command, options=[*env_options, "--ranks", "2"], user=owner)
        daemon.wait_state(job, "RUNNING")
        progress = 0
        for _ in range(2):
            progress = wait_progress(daemon, job, progress + 10, steps=steps)
            result = daemon.sing("preempt", str(job), user=owner)
            assert result.code == 0, result.err
            daemon.wait_state(job, "RUNNING")
            assert_runs_as_owner(daemon, job)
        release.touch()
        daemon.wait_ok(job, timeout=300)
        outputs = [daemon.sing("logs", "--rank", str(rank), str(job)).out for rank in range(2)]
    assert [without_name_lookup_warnings(output) for output in outputs] == expected


def without_name_lookup_warnings(log: str) -> str:
    """A rank's log less c10d's time-stamped warning that a peer's host name could not be looked
    up, which a job with a loopback-only network gets once at start (no DNS server is reachable)."""
    lines = log.splitlines(keepends=True)
    return "".join(line for line in lines if not ("[c10d]" in line and "hostname" in line))


def test_checkpoints_an_ended_job_still_holds_are_removed_when_the_daemon_starts(cr_daemon: Daemon) -> None:
    """A job's checkpoints go when it ends; where a daemon stopped before removing them (or an
    older one kept them), the next start removes them, saying so."""
    release = release_file(cr_daemon)
    job = submit_counter(cr_daemon, release)
    cr_daemon.wait_state(job, "RUNNING")
    assert cr_daemon.sing("checkpoint", str(job)).code == 0
    folder = cr_daemon.state_dir / "checkpoints" / str(job)
    taken = [p for p in folder.iterdir() if p.name[0].isdigit()]
    assert len(taken) == 1
    kept = cr_daemon.root / "kept-checkpoint"
    subprocess.run(["cp", "-a", str(taken[0]), str(kept)], check=True)
    release.touch()
    cr_daemon.wait_ok(job)

    def removals() -> list[str]:
        return [e["reason"] for e in events(cr_daemon, job) if "checkpoints were removed" in e["reason"]]

    wait_until(removals, timeout=60)
    cr_daemon.stop()
    subprocess.run(["cp", "-a", str(kept), str(taken[0])], check=True)
    cr_daemon.start()
    again = wait_until(lambda: len(removals()) == 2 and removals(), timeout=60)
    assert again[1].startswith("its checkpoints were removed (") and not taken[0].exists()
    assert cr_daemon.job(job)["state"] == "COMPLETED"
