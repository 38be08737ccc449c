"""Every OpInfo sample gives the same bits on the proxied `cuda` as directly on the CPU.

`tests/programs/op_differential.py` runs as a job on a proxied device and prints each failing
sample; this test collects them, grouped by operator with the first error. A job process that
ends early (a lost session, a crash) is a failure of the operator it was running, and the run
goes on from the next operator, so that one failure cannot hide the others.
"""

from __future__ import annotations

import json
import subprocess
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from tests.proxy.conftest import PROGRAMS, PYTHON, ProxyServer, proxy_env

PROGRAM = PROGRAMS / "op_differential.py"
RESTARTS = 20
"""Most job processes one run may need before the test gives up (each lost one is a failure)."""


@dataclass
class Outcome:
    """What the differential runs found."""

    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    failures: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    not_compared: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    """Samples that give other bits from run to run on the CPU itself, by operator."""
    ended_early: list[str] = field(default_factory=list)

    def report(self) -> str:
        """Failures grouped by operator: how many samples, which dtypes, the first error."""
        lines = [
            f"{sum(len(v) for v in self.failures.values())} failing samples in {len(self.failures)} operators"
        ]
        for name, errors in sorted(self.failures.items()):
            lines.append(f"  {name}: {len(errors)} x, first: {errors[0]}")
        return "\n".join(lines)


def _name(record: dict[str, Any]) -> str:
    """An OpInfo entry's name with its variant, from a line of the program."""
    name = record.get("op", record.get("name", "?"))
    return str(name) + (f".{record['variant']}" if record.get("variant") else "")


def run_differential(server: ProxyServer, job: str, extra: list[str], timeout: float = 600) -> Outcome:
    """Run the differential program on the proxied device until it has covered every operator."""
    outcome = Outcome()
    start = 0
    for attempt in range(RESTARTS):
        command = [PYTHON, str(PROGRAM), "--start", str(start), *extra]
        run = subprocess.run(
            command,
            env=proxy_env([server.socket], f"{job}-{attempt}"),
            cwd=PROGRAMS,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        current: dict[str, Any] | None = None
        finished = False
        for line in run.stdout.splitlines():
            if not line.startswith("{"):
                continue
            record: dict[str, Any] = json.loads(line)
            if "begin" in record:
                current = record
            elif "done" in record:
                finished = True
                for outcome_name, count in record["done"].items():
                    outcome.counts[outcome_name] += count
            else:
                name = _name(record)
                found = outcome.failures if record["outcome"] == "fail" else outcome.not_compared
                found[name].append(f"{record['dtype']} sample {record['sample']}: {record['error']}")
        if finished:
            return outcome
        tail = (run.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
        outcome.ended_early.append(tail)
        if current is None:
            raise AssertionError(f"the differential program failed to start: {run.stderr[-3000:]}")
        outcome.failures[_name(current)].append(f"the job process ended: {tail}")
        start = current["begin"] + 1
    raise AssertionError(f"the job process ended early {RESTARTS} times:\n" + "\n".join(outcome.ended_early))


def test_every_opinfo_sample_is_bit_identical_on_the_proxied_device(server: ProxyServer) -> None:
    outcome = run_differential(server, "op-coverage", [])
    assert outcome.counts["ok"] > 6000, dict(outcome.counts)
    assert not outcome.failures, outcome.report()
    assert not outcome.ended_early
    # only samples known to differ between two CPU runs go uncompared (a new one is to classify)
    reasons = {error for errors in outcome.not_compared.values() for error in errors}
    assert all("gelsy" in reason for reason in reasons), reasons


def test_differential_check_finds_a_wrong_value(server: ProxyServer) -> None:
    """The check can fail: a program whose device results are wrong is caught by operator."""
    outcome = run_differential(server, "op-coverage-broken", ["--only", "add", "mul", "--break", "add"])
    assert set(outcome.failures) == {"add"}, outcome.report()
    assert "values differ" in outcome.failures["add"][0]


def test_a_job_process_ending_early_fails_its_operator_and_the_run_goes_on(server: ProxyServer) -> None:
    outcome = run_differential(server, "op-coverage-crash", ["--only", "add", "mul", "sub", "--crash", "mul"])
    assert list(outcome.failures) == ["mul"], outcome.report()
    assert "the job process ended" in outcome.failures["mul"][0]
    assert outcome.counts["ok"] > 0  # sub, after it in op_db, ran in a second job process
