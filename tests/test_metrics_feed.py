"""Metrics fed by the change feed, on the real daemon, store and state machine with fakes for the
processes, checkpoints and devices (no root, milliseconds); and the Grafana dashboard's queries
against the metrics the daemon really exposes."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from singularityd.config import Config
from singularityd.core.states import JobState
from singularityd.daemon import Daemon
from singularityd.devices.inventory import Inventory, virtual_devices
from singularityd.errors import StateConflict
from singularityd.observe.feed import ConfigReloaded, SpoolFileHandled
from singularityd.observe.metrics import DeviceSampler, Metrics
from singularityd.requests import Requests
from singularityd.store import Store
from tests.helpers import REPO
from tests.test_orchestration import (
    ROOT,
    Clock,
    FakeCheckpoints,
    FakeDevices,
    FakeProcesses,
    Harness,
    running_job,
    settle,
)

DASHBOARD = REPO / "docs" / "grafana-dashboard.json"


class Metered(Harness):
    """A daemon on fakes whose change feed feeds a Metrics."""

    metrics: Metrics

    def value(self, name: str, **labels: str) -> float:
        """A sample's value (0 when the series does not exist)."""
        found = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if found is None else found


@pytest.fixture
async def metered(tmp_path: Path) -> AsyncIterator[Metered]:
    config = Config(socket=tmp_path / "sing.sock", state_dir=tmp_path)
    inventory = Inventory(virtual_devices(1, 1.0), "not used")
    store = Store(tmp_path / "singularity.db")
    processes, checkpoints, devices = FakeProcesses(tmp_path / "jobs"), FakeCheckpoints(), FakeDevices()
    clock = Clock()
    daemon = Daemon(config, store, inventory, processes, checkpoints, devices, clock)  # type: ignore[arg-type]
    metrics = Metrics(DeviceSampler(inventory, None))
    metrics.load(store)
    daemon.feed.observe(metrics.observe)
    await daemon.start()
    h = Metered(daemon, Requests(daemon), processes, checkpoints, devices, clock, str(tmp_path))
    h.metrics = metrics
    yield h
    await daemon.stop()


async def test_a_scheduler_preemption_and_restore_are_counted(metered: Metered) -> None:
    h = metered
    low = await running_job(h, priority=0)
    assert h.value("singularity_job_state", job=str(low), user="root", state="RUNNING") == 1
    high = h.submit(priority=10)
    await settle()
    assert h.job(low).state is JobState.PREEMPTED and h.job(high).state is JobState.RUNNING
    assert h.value("singularity_preemptions_total", trigger="scheduler") == 1
    assert h.value("singularity_preemptions_total", trigger="user") == 0
    assert h.value("singularity_checkpoints_total", trigger="scheduler", outcome="ok") == 1
    assert h.value("singularity_checkpoint_pause_seconds_count") == 1
    assert h.value("singularity_checkpoint_pause_seconds_sum") == pytest.approx(0.01)
    assert h.value("singularity_checkpoint_size_bytes_sum") == 100
    assert h.value("singularity_checkpoint_duration_seconds_count") == 1
    assert h.value("singularity_job_state", job=str(low), user="root", state="PREEMPTED") == 1
    assert h.value("singularity_job_state", job=str(low), user="root", state="RUNNING") == 0
    assert h.value("singularity_jobs", state="PREEMPTED") == 1
    assert h.value("singularity_jobs", state="RUNNING") == 1
    assert h.value("singularity_jobs_submitted_total") == 2
    assert h.value("singularity_scheduler_round_seconds_count") >= 2
    assert h.value("singularity_restores_total", outcome="ok") == 0

    h.processes.end(h.pid(high), high, exit_code=0)
    await settle()
    assert h.job(low).state is JobState.RUNNING
    assert h.value("singularity_restores_total", outcome="ok") == 1
    assert h.value("singularity_restore_duration_seconds_count") == 1
    assert h.value("singularity_jobs", state="COMPLETED") == 1
    ended = h.value("singularity_job_state", job=str(high), user="root", state="RUNNING")
    assert ended == 0, "ended jobs leave the table"
    assert h.value("singularity_job_transitions_total", from_state="RUNNING", to_state="PREEMPTED") == 1


async def test_user_requests_are_told_apart(metered: Metered) -> None:
    h = metered
    job = await running_job(h)
    await h.requests.checkpoint(ROOT, job)
    await h.requests.preempt(ROOT, job, hold=True)
    assert h.value("singularity_checkpoints_total", trigger="request", outcome="ok") == 1
    assert h.value("singularity_checkpoints_total", trigger="suspend", outcome="ok") == 1
    assert h.value("singularity_suspensions_total") == 1
    assert h.value("singularity_preemptions_total", trigger="user") == 0
    h.requests.resume(ROOT, job)
    await settle()
    await h.requests.preempt(ROOT, job, hold=False)
    assert h.value("singularity_preemptions_total", trigger="user") == 1


async def test_failed_checkpoints_and_the_other_observations(metered: Metered) -> None:
    h = metered
    job = await running_job(h)
    gate = h.checkpoints.hold()
    gate.set_result("No space left on device")
    with pytest.raises(StateConflict, match="No space left"):
        await h.requests.checkpoint(ROOT, job)
    assert h.value("singularity_checkpoints_total", trigger="request", outcome="failed") == 1
    assert h.value("singularity_checkpoint_pause_seconds_count") == 0
    h.daemon.feed.report(ConfigReloaded(("log_level",), ()))
    h.daemon.feed.report(ConfigReloaded((), (), "bad file"))
    h.daemon.feed.report(SpoolFileHandled("a.toml", 7))
    h.daemon.feed.report(SpoolFileHandled("b.toml", None, "unknown field"))
    assert h.value("singularity_config_reloads_total", outcome="applied") == 1
    assert h.value("singularity_config_reloads_total", outcome="failed") == 1
    assert h.value("singularity_spool_files_total", outcome="submitted") == 1
    assert h.value("singularity_spool_files_total", outcome="refused") == 1


async def test_the_job_table_starts_from_the_store(metered: Metered) -> None:
    h = metered
    await running_job(h)
    queued = h.submit()
    fresh = Metrics(DeviceSampler(h.daemon.inventory, None))
    fresh.load(h.daemon.store)
    assert fresh.registry.get_sample_value("singularity_jobs", {"state": "RUNNING"}) == 1
    assert fresh.registry.get_sample_value("singularity_jobs", {"state": "PENDING"}) == 1
    labels = {"job": str(queued), "user": "root", "state": "PENDING"}
    assert fresh.registry.get_sample_value("singularity_job_state", labels) == 1


async def test_a_failing_observer_does_not_reach_the_daemon(metered: Metered) -> None:
    h = metered

    def broken(_: object) -> None:
        raise RuntimeError("observer bug")

    h.daemon.feed.observe(broken)
    job = await running_job(h)
    assert h.job(job).state is JobState.RUNNING


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the dashboard's panels."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def test_dashboard_queries_name_metrics_the_daemon_exposes() -> None:
    metrics = Metrics(DeviceSampler(Inventory(virtual_devices(1, 1.0), "not used"), None))
    exposed: set[str] = set()
    for family in metrics.registry.collect():
        exposed |= {sample.name for sample in family.samples} | {family.name}
        if family.type == "counter":  # a labelled counter has no sample before its first use
            exposed.add(f"{family.name}_total")
    # Families sampled only when a device's proxy runs or NVML reports utilisation.
    exposed |= {
        "singularity_device_utilization_ratio",
        "singularity_proxy_operations_total",
        "singularity_proxy_batches_total",
        "singularity_proxy_busy_seconds_total",
        "singularity_proxy_sessions",
    }
    queries = dashboard_queries()
    assert len(queries) >= 10
    named = {name for query in queries for name in re.findall(r"\bsingularity_[a-z_]+", query)}
    assert named, "the dashboard queries singularity metrics"
    assert named <= exposed, f"not exposed: {sorted(named - exposed)}"
    wanted = ["device_memory", "utilization", "jobs", "preemptions", "restores", "checkpoint_pause",
              "checkpoint_duration", "checkpoint_size", "scheduler_round", "proxy_operations"]  # fmt: skip
    for topic in wanted:
        assert any(topic in name for name in named), f"no panel shows {topic}"
