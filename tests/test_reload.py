"""Live config reload of a real daemon: the config file is edited while it runs (inotify through
watchdog, or SIGHUP), the live options take effect at once, the others are reported as needing a
restart, and a bad file changes nothing."""

from __future__ import annotations

import signal
from pathlib import Path

from tests.conftest import requires_root
from tests.helpers import Daemon, ensure_user, running_daemon, wait_until
from tests.test_metrics import metrics_url, scrape, value

ADMINS = "sing-reload-admins"
CAROL = "sing-reload-carol"


def rewrite_config(daemon: Daemon, **options: object) -> int:
    """Change the daemon's config file; returns how many reload lines its log had before."""
    before = reload_lines(daemon)
    daemon.config.update(options)
    daemon.write_config()
    return before


def reload_lines(daemon: Daemon) -> int:
    text = daemon.log.read_text()
    return text.count("config reloaded from") + text.count("config reload failed")


def wait_reload(daemon: Daemon, before: int) -> str:
    """Wait for the next reload line of the daemon's log; returns the log."""
    wait_until(lambda: reload_lines(daemon) > before, timeout=30)
    return daemon.log.read_text()


def hold_command(daemon: Daemon) -> list[str]:
    release = daemon.root / "release"
    return ["sh", "-c", f"while [ ! -e {release} ]; do sleep 0.05; done"]


def test_live_options_apply_at_once_and_the_others_wait_for_a_restart(daemon_root: Path) -> None:
    config = {"metrics": False, "log_level": "info"}
    with running_daemon(daemon_root, config=config, log_level=None) as daemon:
        job = daemon.submit(*hold_command(daemon), options=["--cwd", "/tmp"])
        assert daemon.job(job)["checkpoint_interval"] == 0
        assert "metrics on http" not in daemon.log.read_text()

        options = {
            "checkpoint_interval_seconds": 900,
            "checkpoint_keep": 4,
            "metrics": True,
            "metrics_port": 0,
        }
        before = rewrite_config(daemon, **options, virtual_device_memory_gib=2)
        log = wait_reload(daemon, before)
        assert "checkpoint_interval_seconds 0.0 -> 900.0" in log
        assert "checkpoint_keep 2 -> 4" in log and "metrics False -> True" in log
        assert "virtual_device_memory_gib 16.0 -> 2.0: needs a restart to take effect" in log
        assert daemon.job(job)["checkpoint_interval"] == 900, "the new default applies to running jobs"
        url = metrics_url(daemon)
        samples = scrape(url)
        assert value(samples, "singularity_config_reloads_total", outcome="applied") == 1
        assert value(samples, "singularity_device_memory_total_bytes", device="0") == 16 * 1024**3

        def reloads(outcome: str) -> float:
            return value(scrape(url), "singularity_config_reloads_total", outcome=outcome) or 0

        rewrite_config(daemon, log_level="warning")
        wait_until(lambda: reloads("applied") == 2)
        quiet = daemon.submit("true", options=["--cwd", "/tmp"])
        assert daemon.sing("wait", str(quiet)).code == 0
        assert f"job {quiet} submitted by" not in daemon.log.read_text(), "log_level warning hides info"

        before = rewrite_config(daemon, virtual_devices=0)
        log = wait_reload(daemon, before)
        assert "config reload failed, keeping the running configuration" in log
        assert "virtual_devices must be at least 1" in log
        assert reloads("failed") == 1
        assert daemon.sing("ps").code == 0
        assert daemon.job(job)["checkpoint_interval"] == 900

        before = rewrite_config(daemon, virtual_devices=4, metrics=False, log_level="info")
        assert "log_level warning -> info; metrics True -> False" in wait_reload(daemon, before)
        assert "metrics endpoint closed" in daemon.log.read_text()
        (daemon.root / "release").touch()
        assert daemon.sing("wait", str(job)).code == 0


def test_sighup_reads_the_file_again(daemon_root: Path) -> None:
    with running_daemon(daemon_root, config={"metrics": False}) as daemon:
        before = rewrite_config(daemon, admin_group="wheel")
        assert "admin_group singularity-admin -> wheel" in wait_reload(daemon, before)
        unchanged = "read again: nothing changed"
        seen = daemon.log.read_text().count(unchanged)
        assert daemon.process is not None
        daemon.process.send_signal(signal.SIGHUP)
        wait_until(lambda: daemon.log.read_text().count(unchanged) > seen)
        assert daemon.sing("ps").code == 0


@requires_root
def test_a_new_admin_group_applies_to_users_already_connected(daemon_root: Path) -> None:
    ensure_user(CAROL, groups=[ADMINS])
    with running_daemon(daemon_root, config={"metrics": False}) as daemon:
        job = daemon.submit(*hold_command(daemon), options=["--cwd", "/tmp"])
        refused = daemon.sing("cancel", str(job), user=CAROL)
        assert refused.code == 5, refused.err
        before = rewrite_config(daemon, admin_group=ADMINS)
        wait_reload(daemon, before)
        allowed = daemon.sing("cancel", str(job), user=CAROL)
        assert allowed.code == 0, allowed.err
        assert daemon.wait_state(job, "CANCELLED")["state"] == "CANCELLED"


@requires_root
def test_checkpoint_keep_applies_to_the_next_checkpoint(daemon_root: Path) -> None:
    with running_daemon(daemon_root, config={"metrics": False, "checkpoint_keep": 3}) as daemon:
        job = daemon.submit(*hold_command(daemon), options=["--cwd", "/tmp"])
        daemon.wait_state(job, "RUNNING")
        for _ in range(2):
            result = daemon.sing("checkpoint", str(job))
            assert result.code == 0, result.err
        assert daemon.job(job)["checkpoints"] == 2
        before = rewrite_config(daemon, checkpoint_keep=1)
        assert "checkpoint_keep 3 -> 1" in wait_reload(daemon, before)
        assert daemon.sing("checkpoint", str(job)).code == 0
        assert daemon.job(job)["checkpoints"] == 1
        (daemon.root / "release").touch()
        assert daemon.sing("wait", str(job)).code == 0
