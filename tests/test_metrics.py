"""The metrics endpoint of a real daemon, scraped over real HTTP on loopback around a real
preemption: a proxied PyTorch job is checkpointed with CRIU and stopped for a job that outranks
it, then restored when that one ends."""

from __future__ import annotations

import os
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import requires_root
from tests.helpers import Daemon, running_daemon, wait_until
from tests.proxy.conftest import PROGRAMS, PYTHON

JOB_OPTIONS = ["--env", "OMP_NUM_THREADS=1", "--cwd", str(PROGRAMS)]
Samples = list[tuple[str, dict[str, str], float]]


def metrics_url(daemon: Daemon) -> str:
    """The endpoint the daemon logged it serves (the last one, after reloads or restarts)."""
    found = wait_until(lambda: re.findall(r"metrics on (http://\S+/metrics)", daemon.log.read_text()))
    return str(found[-1])


def scrape(url: str) -> Samples:
    """Every sample the endpoint serves now."""
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        text = response.read().decode()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The value of the one sample with this name and (at least) these labels; None if none."""
    found = [v for n, have, v in samples if n == name and labels.items() <= have.items()]
    assert len(found) <= 1, f"{name} {labels} matches {len(found)} samples"
    return found[0] if found else None


def steps(daemon: Daemon, job: int) -> int:
    log = daemon.state_dir / "jobs" / str(job) / "logs" / "rank-0.log"
    return log.read_text().count("step ") if log.exists() else 0


@requires_root
@pytest.mark.slow
def test_a_scrape_after_a_real_preemption(daemon_root: Path) -> None:
    release_low, release_high = daemon_root / "release-low", daemon_root / "release-high"
    with running_daemon(daemon_root, virtual_devices=1, config={"metrics_port": 0}) as daemon:
        url = metrics_url(daemon)
        assert url.startswith("http://127.0.0.1:"), "loopback by default"
        args = ["--steps", "60", "--hold", str(release_low)]
        low = daemon.submit(PYTHON, "long_train.py", *args, options=JOB_OPTIONS)
        daemon.wait_state(low, "RUNNING")
        wait_until(lambda: steps(daemon, low) >= 10, timeout=120)

        running = scrape(url)
        assert value(running, "singularity_job_state", job=str(low), state="RUNNING") == 1
        assert value(running, "singularity_jobs", state="RUNNING") == 1
        assert value(running, "singularity_proxy_up", device="0") == 1
        assert (value(running, "singularity_device_memory_used_bytes", device="0") or 0) > 0
        assert (value(running, "singularity_proxy_operations_total", device="0") or 0) > 0
        assert (value(running, "singularity_proxy_busy_seconds_total", device="0") or 0) > 0
        utilization = value(running, "singularity_device_utilization_ratio", device="0")
        assert utilization is not None and 0 <= utilization <= 1, "a virtual device's, from its server"
        assert value(running, "singularity_preemptions_total", trigger="scheduler") == 0
        assert value(running, "singularity_checkpoint_pause_seconds_count") == 0

        hold = f"while [ ! -e {release_high} ]; do sleep 0.05; done"
        high = daemon.submit("sh", "-c", hold, options=["--priority", "10"])
        daemon.wait_state(high, "RUNNING", timeout=120)
        assert daemon.job(low)["state"] == "PREEMPTED"

        preempted = scrape(url)
        assert value(preempted, "singularity_preemptions_total", trigger="scheduler") == 1
        assert value(preempted, "singularity_device_utilization_ratio", device="0") == 0, "its server is gone"
        assert value(preempted, "singularity_job_state", job=str(low), state="PREEMPTED") == 1
        assert value(preempted, "singularity_job_state", job=str(low), state="RUNNING") is None
        assert value(preempted, "singularity_job_state", job=str(high), state="RUNNING") == 1
        assert value(preempted, "singularity_jobs", state="PREEMPTED") == 1
        assert value(preempted, "singularity_checkpoints_total", trigger="scheduler", outcome="ok") == 1
        assert value(preempted, "singularity_checkpoint_pause_seconds_count") == 1
        assert (value(preempted, "singularity_checkpoint_pause_seconds_sum") or 0) > 0
        assert value(preempted, "singularity_checkpoint_duration_seconds_count") == 1
        shown = daemon.job(low)
        size = value(preempted, "singularity_checkpoint_size_bytes_sum") or 0
        assert 0 < size <= shown["checkpoint_bytes"]
        assert value(preempted, "singularity_device_memory_used_bytes", device="0") == 0, "the proxy freed it"
        assert (value(preempted, "singularity_scheduler_round_seconds_count") or 0) >= 2

        release_high.touch()
        daemon.wait_state(low, "RUNNING", timeout=120)

        def restored_once() -> Samples | None:
            samples = scrape(url)
            return samples if value(samples, "singularity_restores_total", outcome="ok") == 1 else None

        restored: Samples = wait_until(restored_once, timeout=120)
        assert value(restored, "singularity_restore_duration_seconds_count") == 1
        assert value(restored, "singularity_jobs", state="COMPLETED") == 1
        release_low.touch()
        assert daemon.sing("wait", str(low), timeout=300).code == 0


def test_metrics_can_be_turned_off(daemon_root: Path) -> None:
    with running_daemon(daemon_root, config={"metrics": False}) as daemon:
        assert "metrics on http" not in daemon.log.read_text()


def test_a_taken_port_leaves_the_daemon_running(daemon_root: Path) -> None:
    with running_daemon(daemon_root / "a", config={"metrics_port": 0}) as first:
        port = int(metrics_url(first).rsplit(":", 1)[1].split("/")[0])
        with running_daemon(daemon_root / "b", config={"metrics_port": port}) as second:
            assert "metrics endpoint off: cannot listen on 127.0.0.1" in second.log.read_text()
            assert second.sing("ps").code == 0
        scrape(metrics_url(first))


def test_the_endpoint_listens_on_127_0_0_1_only(daemon_root: Path) -> None:
    with running_daemon(daemon_root, config={"metrics_port": 0}) as daemon:
        url = metrics_url(daemon)
        mode = "system" if os.geteuid() == 0 else "user"
        assert value(scrape(url), "singularity_daemon_info", mode=mode) == 1
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(url.replace("127.0.0.1", "127.0.0.2"), timeout=5)
