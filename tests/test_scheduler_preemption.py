"""The scheduler preempting through the real daemon: a job that a queued one outranks (a higher
priority, or a higher tier whatever the priorities) is checkpointed for it, and resumes exactly
where it stopped (bitwise, as in test_preempt.py, whose training workload and helpers it uses)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import requires_root
from tests.helpers import running_daemon
from tests.test_preempt import events, release_file, submit_training, uninterrupted_output, wait_progress

pytestmark = [requires_root, pytest.mark.slow]


def test_scheduler_preempts_lower_priority_job(daemon_root: Path) -> None:
    with running_daemon(daemon_root, virtual_devices=1) as daemon:
        release = release_file(daemon)
        low = submit_training(daemon, "--priority", "0", steps=150, hold=release)
        daemon.wait_state(low, "RUNNING")
        wait_progress(daemon, low, 10, steps=150)
        high = daemon.submit("sh", "-c", "echo urgent", options=["--priority", "10"])
        daemon.wait_ok(high, timeout=120)
        reasons = [e["reason"] for e in events(daemon, low)]
        assert any(
            r.startswith(f"preempted for job {high}, which outranks it: checkpoint") for r in reasons
        ), reasons
        release.touch()
        daemon.wait_ok(low, timeout=300)
        assert daemon.sing("logs", str(low)).out == uninterrupted_output(150)
        high_events = events(daemon, high)
        assert high_events[1]["to_state"] == "RUNNING"


def test_a_higher_tier_preempts_a_lower_one_whatever_its_priority(daemon_root: Path) -> None:
    """A basic job of priority 50 gives its device to a standard job of priority 0, then resumes
    exactly where it stopped; the tiers show in `sing ps` and `sing show`, and an unknown tier is
    refused."""
    with running_daemon(daemon_root, virtual_devices=1) as daemon:
        refused = daemon.sing("submit", "--tier", "gold", "--", "true")
        assert refused.code == 2
        assert "--tier must be one of basic, standard, premium, not 'gold'" in refused.err
        release = release_file(daemon)
        basic = submit_training(daemon, "--tier", "basic", "--priority", "50", steps=150, hold=release)
        daemon.wait_state(basic, "RUNNING")
        wait_progress(daemon, basic, 10, steps=150)
        hold = daemon.root / "standard-hold"
        standard = daemon.submit("sh", "-c", f"while [ ! -e {hold} ]; do sleep 0.1; done; echo urgent")
        daemon.wait_state(standard, "RUNNING", timeout=120)
        listed = {row.split()[0]: row.split() for row in daemon.sing("ps").out.splitlines()[1:]}
        assert listed[str(basic)][3:6] == ["PREEMPTED", "basic", "50"], listed
        assert listed[str(standard)][3:6] == ["RUNNING", "standard", "0"], listed
        assert "Tier:       basic" in daemon.sing("show", str(basic)).out
        hold.touch()
        daemon.wait_ok(standard, timeout=120)
        release.touch()
        daemon.wait_ok(basic, timeout=300)
        assert daemon.sing("logs", str(basic)).out == uninterrupted_output(150)
        assert daemon.job(basic)["tier"] == "basic"
