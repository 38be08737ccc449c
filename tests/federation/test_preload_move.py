"""A move's target reads the pre-copied device state onto its devices while the job still runs on
its source, and its restore reads only what was written after the pause (two real daemons in a lab).

The job (tests/programs/held_state.py) holds 64 MiB it only reads beside a small model it trains.
Moved, it must end byte-identical to an uninterrupted run, the target's restore having taken the
pre-copied storages preloaded; a move given up after the preload leaves nothing on the target.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from singularity.proxy.control import ControlError, ProxyControl
from singularityd import faults
from tests.federation.lab import Lab, Node, joined_lab
from tests.federation.test_lab import Background, lab_problem, migrate, progressed, wait_state
from tests.helpers import wait_until
from tests.proxy.conftest import PYTHON
from tests.test_daemon_proxy import JOB_OPTIONS, direct_output

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.xdist_group("preload-lab")]

HELD_MIB = 64
STEPS = 200
ARGS = ["--mib", str(HELD_MIB), "--steps", str(STEPS)]
UNITS = {"B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    """node-a and node-b joined in a lab."""
    why = lab_problem()
    if why:
        pytest.skip(why)
    config = {"move_timeout_seconds": 60.0, "move_hold_seconds": 60.0}
    with joined_lab(("node-a", "node-b"), f"pre{os.getpid() % 10000}", config) as made:
        yield made


def submit_held_state(node: Node, release: Path) -> int:
    """Submit the proxied program; it holds before its last line until `release` exists."""
    result = node.sing("submit", *JOB_OPTIONS, "--", PYTHON, "held_state.py", *ARGS, "--hold", str(release))
    assert result.code == 0, result.err
    return int(result.out.strip())


def proxy_controls(node: Node, job: int) -> list[Path]:
    """The control sockets of the job's proxy servers on a node."""
    return sorted((node.state_dir / "proxy" / "control").glob(f"job-{job}-dev-*.sock"))


def preloaded_on(node: Node, job: int) -> int:
    """Bytes of device state the node's proxy servers hold preloaded for the job."""
    total = 0
    for control in proxy_controls(node, job):
        with contextlib.suppress(OSError, ControlError, EOFError), ProxyControl(control, timeout=5) as proxy:
            total += int(proxy.status().get("preloaded", {}).get(str(job), 0))
    return total


def size(text: str) -> int:
    """Bytes of a size as events write it (human_bytes: '64.0M')."""
    return int(float(text[:-1]) * UNITS[text[-1]])


def test_the_target_restores_from_the_preloaded_state_and_reads_only_the_rest(lab: Lab) -> None:
    expected = direct_output("held_state.py", ARGS)
    release = lab.paths.root / "release-preload"
    a, b = lab.node("node-a"), lab.node("node-b")
    job = submit_held_state(a, release)
    wait_state(a, job, "RUNNING")
    wait_until(progressed(a, job, 20), timeout=240)
    migrate(a, job, "node-b")
    wait_state(b, job, "RUNNING")
    assert preloaded_on(b, job) == 0, "the restore took what was preloaded"
    release.touch()
    assert b.sing("wait", str(job), timeout=300).code == 0, b.sing("logs", str(job)).out[-2000:]
    assert b.sing("logs", str(job)).out == expected
    arrived = b.job(job)
    assert arrived is not None
    events = [str(e["reason"]) for e in arrived["events"]]
    preloads = [e for e in events if re.match(r"preloaded \S+ of device state on device \d+ in ", e)]
    assert len(preloads) == 1, events
    restore = next(e for e in events if e.startswith("restore frozen took"))
    found = re.search(r"device state loaded in [0-9.]+s \((\S+) read, (\S+) taken preloaded\)", restore)
    assert found, restore
    read, taken = size(found.group(1)), size(found.group(2))
    assert taken >= HELD_MIB << 20, restore
    assert read < 1 << 20, f"the restore read more than what the job wrote after its pre-copy: {restore}"


def test_the_source_stops_the_job_only_once_the_target_has_preloaded(lab: Lab) -> None:
    """The target holds at the end of its preload (a fault point): its answer to the pre-send waits,
    so the job still runs on the source, not stopped; once the preload is over the move goes on,
    and the job ends on the target, exact."""
    expected = direct_output("held_state.py", ARGS)
    release, hold = lab.paths.root / "release-preload-wait", lab.paths.root / "hold-preloaded"
    a, b = lab.node("node-a"), lab.node("node-b")
    b.kill(signal.SIGTERM)
    b.start(env={faults.ENV: faults.PRELOADED, faults.HOLD_ENV: str(hold)})
    try:
        job = submit_held_state(a, release)
        wait_state(a, job, "RUNNING")
        wait_until(progressed(a, job, 20), timeout=240)
        mover = Background(lambda: a.sing("migrate", str(job), "--to", "node-b", timeout=300))
        wait_until(lambda: Path(f"{hold}.reached").exists(), timeout=120, interval=0.05)
        time.sleep(1.0)
        shown = a.job(job)
        assert shown is not None and shown["state"] == "RUNNING", shown
        reasons = [str(e["reason"]) for e in shown["events"]]
        assert not any(r.startswith("stopped to move") for r in reasons), reasons
        hold.touch()
        assert mover.result().code == 0, mover.result().err
        wait_state(b, job, "RUNNING")
        release.touch()
        assert b.sing("wait", str(job), timeout=300).code == 0, b.sing("logs", str(job)).out[-2000:]
        assert b.sing("logs", str(job)).out == expected
    finally:
        hold.touch()
        release.touch()
        b.kill(signal.SIGTERM)
        b.start()


@pytest.mark.parametrize("then", ["discarded", "target-restarted"])
def test_a_move_given_up_after_the_preload_leaves_nothing_on_the_target(lab: Lab, then: str) -> None:
    """The source dies as CRIU begins its final dump (a fault point), after the target preloaded;
    the move is given up (the target told to discard the epoch, or the target restarted first), the
    job resumes on the source (exact), and the target keeps no server and no preloaded byte of it.
    While the preload held a device of the target, a job submitted there for all its devices waited;
    it runs once the preload is dropped."""
    expected = direct_output("held_state.py", ARGS)
    release = lab.paths.root / f"release-given-up-{then}"
    a, b = lab.node("node-a"), lab.node("node-b")
    a.kill(signal.SIGTERM)
    a.start(env={faults.ENV: faults.STOPPING_DUMP_RUNNING})
    try:
        job = submit_held_state(a, release)
        wait_state(a, job, "RUNNING")
        wait_until(progressed(a, job, 20), timeout=240)
        mover = Background(lambda: a.sing("migrate", str(job), "--to", "node-b", timeout=300))
        assert a.process is not None
        assert a.process.wait(120) == -signal.SIGKILL
        a.process = None
        assert mover.result().code != 0
        wait_until(lambda: preloaded_on(b, job) >= HELD_MIB << 20, timeout=60)
        local = b.sing("submit", *JOB_OPTIONS, "--gpus", "2", "--", PYTHON, "-c", "print('local')")
        assert local.code == 0, local.err
        local_job = int(local.out.strip())
        for _ in range(10):  # the round its submit asked for has run by the end
            shown = b.job(local_job)
            assert shown is not None and shown["state"] == "PENDING", shown
            time.sleep(0.3)
        if then == "target-restarted":
            b.kill(signal.SIGKILL)
            b.start()
            wait_until(lambda: not proxy_controls(b, job), timeout=20)  # before its hold could end
    finally:
        if a.process is None:
            a.start()
    wait_state(a, job, "RUNNING", timeout=180)
    wait_until(lambda: not proxy_controls(b, job), timeout=120)
    assert preloaded_on(b, job) == 0
    assert b.sing("wait", str(local_job), timeout=120).code == 0
    release.touch()
    done = a.sing("wait", str(job), timeout=300)
    assert done.code == 0, a.sing("show", str(job)).out + a.sing("logs", str(job)).out[-2000:]
    assert a.sing("logs", str(job)).out == expected
