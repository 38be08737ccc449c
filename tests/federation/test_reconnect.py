"""A move to a target daemon that is restarting: PREPARE keeps trying to reach it for a while.

Two real daemons in a lab (lab.py). The target is stopped before `sing migrate` is asked; the
source finds its connection refused and says so in the job's events while it tries again. Started
again within that time, the target takes the job, which finishes byte-identical to an
uninterrupted run. A target that stays down makes the move fail with one line naming it, a
non-zero exit, and the job running on where it was, its output exact too.

Heartbeats are slow here (a peer turns dead after 10 missed: 30 s), so that the source still
counts the stopped target as a member it may move a job to when the move is asked.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from tests.federation.lab import Lab, Node, joined_lab
from tests.federation.test_lab import Background, lab_problem, steps_done, submit_train, wait_state
from tests.helpers import wait_until
from tests.test_daemon_proxy import direct_output

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.xdist_group("reconnect-lab")]

NODES = ("node-a", "node-b")
STEPS = 120
CONNECT_S = 20.0


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    """node-a and node-b joined in a lab; a move tries to reach its target for CONNECT_S seconds."""
    why = lab_problem()
    if why:
        pytest.skip(why)
    config = {
        "heartbeat_seconds": 3.0,
        "move_connect_seconds": CONNECT_S,
        "move_timeout_seconds": 120.0,
        "move_hold_seconds": 120.0,
    }
    with joined_lab(NODES, f"rec{os.getpid() % 10000}", config) as made:
        yield made


def reasons(node: Node, job: int) -> list[str]:
    """The job's event reasons on a node."""
    shown: dict[str, Any] = node.job(job) or {}
    return [str(event["reason"]) for event in shown.get("events", [])]


def retrying(node: Node, job: int, peer: str) -> bool:
    """Whether the node has recorded that PREPARE could not reach `peer` and is trying again."""
    return any(r.startswith(f"PREPARE: cannot reach {peer}") for r in reasons(node, job))


def finish(node: Node, job: int, release: Any) -> str:
    """Let the job end on `node` and return its whole log."""
    release.touch()
    ended = node.sing("wait", str(job), timeout=300)
    assert ended.code == 0, node.sing("logs", str(job)).out[-2000:]
    return node.sing("logs", str(job)).out


def test_a_move_asked_while_the_target_restarts_reaches_it_and_is_exact(lab: Lab) -> None:
    expected = direct_output("long_train.py", ["--steps", str(STEPS)])
    a, b = lab.node("node-a"), lab.node("node-b")
    release = lab.paths.root / "release-restart"
    job = submit_train(a, release, STEPS)
    wait_state(a, job, "RUNNING")
    wait_until(lambda: steps_done(a, job) > 5, timeout=120)
    b.kill(signal.SIGTERM)
    mover = Background(lambda: a.sing("migrate", str(job), "--to", "node-b", timeout=300))
    wait_until(lambda: retrying(a, job, "node-b") or mover.done(), timeout=60, interval=0.1)
    assert not mover.done(), mover.result()
    b.start()
    moved = mover.result()
    assert (moved.code, moved.out.strip()) == (0, f"job {job} moved to node-b"), moved
    wait_state(b, job, "RUNNING")
    assert (a.job(job) or {})["state"] == "MOVED"
    assert finish(b, job, release) == expected


def test_a_move_to_a_target_that_stays_down_fails_with_one_line_and_the_job_runs_on(lab: Lab) -> None:
    expected = direct_output("long_train.py", ["--steps", str(STEPS)])
    a, b = lab.node("node-a"), lab.node("node-b")
    lab.wait_all_alive()
    release = lab.paths.root / "release-down"
    job = submit_train(a, release, STEPS)
    wait_state(a, job, "RUNNING")
    wait_until(lambda: steps_done(a, job) > 5, timeout=120)
    b.kill(signal.SIGTERM)
    try:
        result = a.sing("migrate", str(job), "--to", "node-b", timeout=300)
        assert (result.code, result.out) == (6, ""), result
        assert result.err.startswith(f"sing: job {job} did not move to node-b: "), result.err
        assert "cannot reach node-b at " in result.err and result.err.count("\n") == 1, result.err
        assert retrying(a, job, "node-b"), reasons(a, job)
        shown = a.job(job) or {}
        assert shown["state"] == "RUNNING", reasons(a, job)
        assert finish(a, job, release) == expected
    finally:
        b.start()
