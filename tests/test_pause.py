"""The pause a checkpoint reports is the one the program feels (real daemon, real CRIU, 1 GiB on the device).

tests/programs/stall_probe.py holds 1 GiB of tensors on its proxied device and prints every step
that took longer than usual, by the wall clock. Around `sing checkpoint` its longest step must
match the pause the daemon reports; around a preemption and the restore after it, the longest
step must match the downtime the restore reports. Agreement: within 10% (or 20 ms). And the
corpus stays byte-identical under checkpoints whose device state was pre-copied while it ran.
"""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import pytest

from tests.conftest import requires_root
from tests.helpers import Daemon, running_daemon, wait_until
from tests.proxy.conftest import PROGRAMS, PYTHON
from tests.proxy.test_corpus import CORPUS
from tests.test_daemon_proxy import direct_run, without_stderr_lines

JOB_OPTIONS = ["--env", "OMP_NUM_THREADS=1", "--cwd", str(PROGRAMS)]


def stalls(log: Path) -> list[tuple[float, float]]:
    """(end, seconds) of each long step the probe printed."""
    found = []
    for line in log.read_text().splitlines():
        if line.startswith("stall "):
            end, seconds = line.split()[1:]
            found.append((float(end), float(seconds)))
    return found


def longest_stall(log: Path, after: float) -> float:
    """The longest step that ended after `after` (wall clock)."""
    return max((seconds for end, seconds in stalls(log) if end > after), default=0.0)


def agree(felt: float, reported: float) -> bool:
    """Whether the daemon's figure is the program's, within 10% or 20 ms."""
    return abs(felt - reported) <= max(0.1 * reported, 0.02)


def events(daemon: Daemon, job: int) -> list[str]:
    """The job's event texts."""
    return [e["reason"] for e in daemon.job(job)["events"]]


@requires_root
def test_reported_pauses_are_what_the_program_lost(daemon_root: Path) -> None:
    hold = daemon_root / "hold"
    with running_daemon(daemon_root, virtual_devices=1) as daemon:
        job = daemon.submit(PYTHON, "stall_probe.py", str(hold), "1024", options=JOB_OPTIONS)
        log = daemon.state_dir / "jobs" / str(job) / "logs" / "rank-0.log"
        wait_until(lambda: log.exists() and "ready" in log.read_text(), timeout=180)

        began = time.time()
        result = daemon.sing("checkpoint", str(job), timeout=600)
        assert result.code == 0, result.err
        printed = float(re.search(r"paused (\d+\.\d+)s", result.out).group(1))  # type: ignore[union-attr]
        listed = daemon.job(job)["checkpoint_list"][-1]
        assert listed["seq"] == 1 and not listed["stopped"]
        reported = listed["pause_seconds"]
        assert abs(printed - reported) < 0.006
        assert listed["precopied_bytes"] >= 1 << 30, "the tensors the job only reads were pre-copied"
        shown = daemon.sing("show", str(job), "-o", "wide").out.splitlines()
        row = next(line.split() for line in shown if line.split()[:1] == ["1"])
        assert "PRE-COPIED" in "".join(shown) and f"{reported:.2f}s" in row, shown
        felt = wait_until(lambda: longest_stall(log, began), timeout=60)
        print(f"checkpoint: the program lost {felt:.3f}s, the daemon says {reported:.3f}s")
        assert agree(felt, reported), f"the program lost {felt:.3f}s, the daemon says {reported:.3f}s"

        began = time.time()
        assert daemon.sing("preempt", str(job), timeout=600).code == 0
        daemon.wait_state(job, "RUNNING", timeout=300)
        restore = wait_until(lambda: next((e for e in events(daemon, job) if "down " in e), None), 300)
        total = float(re.search(r"down (\d+\.\d+)s in all", restore).group(1))  # type: ignore[union-attr]
        stopped = next(e for e in events(daemon, job) if e.startswith("preempted by"))
        assert re.search(r"stopped in \d+\.\d+s", stopped), stopped
        felt = wait_until(lambda: longest_stall(log, began + total / 2), timeout=60)
        print(f"preempt and resume: the program was down {felt:.3f}s, the daemon says {total:.3f}s")
        assert agree(felt, total), f"the program was down {felt:.3f}s, the daemon says {total:.3f}s"

        hold.touch()
        assert daemon.sing("wait", str(job), timeout=300).code == 0
    assert "done: 1024 MiB held, True, checksum 268435456" in log.read_text()


@pytest.mark.timeout(1200)  # ten programs, each checkpointed five times, on two shared cores
@requires_root
def test_corpus_is_exact_under_checkpoints_taken_while_precopy_runs(daemon_root: Path) -> None:
    """Every corpus program, checkpointed in place at 4 random moments and then preempted (each with
    its device state pre-copied while it ran) and restored, prints what it prints directly."""
    rng = random.Random(11)
    expected = {program: direct_run(program, direct_args) for program, direct_args, _ in CORPUS}
    with running_daemon(daemon_root, virtual_devices=4) as daemon:
        jobs = {}
        for program, _, proxy_args in CORPUS:
            hold = daemon_root / f"hold-{program}"
            options = [*JOB_OPTIONS, "--env", f"CORPUS_HOLD={hold}"]
            jobs[program] = (daemon.submit(PYTHON, program, *proxy_args, options=options), hold)
        for program, (job, hold) in jobs.items():
            daemon.wait_state(job, "RUNNING", timeout=600)
            for _ in range(4):
                time.sleep(rng.uniform(0.0, 1.5))
                result = daemon.sing("checkpoint", str(job), timeout=600)
                assert result.code == 0, f"{program}: {result.err}"
            time.sleep(rng.uniform(0.0, 1.5))
            assert daemon.sing("preempt", str(job), timeout=600).code == 0, program
            daemon.wait_state(job, "RUNNING", timeout=600)
            listed = daemon.job(job)["checkpoint_list"]  # read while it runs: an ended job's go
            assert [c["stopped"] for c in listed][-1:] == [True], program
            assert all(c["pause_seconds"] > 0 for c in listed), program
            hold.touch()
            assert daemon.sing("wait", str(job), timeout=600).code == 0, daemon.sing("logs", str(job)).out
            log = daemon.sing("logs", str(job)).out
            assert without_stderr_lines(log, expected[program].stderr) == expected[program].stdout, program
