"""Configuration: defaults, file, environment and flags, and clear errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from singularityd.config import (
    LIVE_OPTIONS,
    OPTIONS,
    Config,
    ConfigError,
    ConfigSource,
    load_config,
    reload_config,
)


def test_defaults_need_no_file() -> None:
    config = load_config(env={})
    assert config.devices == "auto"
    assert config.virtual_devices == 4
    if os.geteuid() == 0:
        assert config.socket == Path("/run/singularity/sing.sock")
        assert config.state_dir == Path("/var/lib/singularity")


def test_every_option_is_documented() -> None:
    documented = set(OPTIONS)
    fields = set(Config.__dataclass_fields__)
    assert documented == fields


def test_precedence_file_env_flag(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('virtual_devices = 2\nsocket = "/tmp/from-file.sock"\nkill_grace_seconds = 3\n')
    config = load_config(path, env={})
    assert (config.virtual_devices, config.socket, config.kill_grace_seconds) == (
        2,
        Path("/tmp/from-file.sock"),
        3.0,
    )
    config = load_config(path, env={"SING_SOCKET": "/tmp/env.sock", "SING_VIRTUAL_DEVICES": "3"})
    assert (config.virtual_devices, config.socket) == (3, Path("/tmp/env.sock"))
    config = load_config(path, env={"SING_SOCKET": "/tmp/env.sock"}, overrides={"socket": "/tmp/flag.sock"})
    assert config.socket == Path("/tmp/flag.sock")


def test_section_table_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[singularityd]\nvirtual_devices = 6\n")
    assert load_config(path, env={}).virtual_devices == 6


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("virtual_devices = 0\n", "at least 1"),
        ("devices = 'gpu'\n", "devices must be"),
        ("bogus = 1\n", "unknown option 'bogus'"),
        ("virtual_devices = 'many'\n", "not a valid value"),
        ("this is not toml", "not valid TOML"),
    ],
)
def test_bad_values_are_clear(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path, env={})


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", env={})


def test_every_option_is_in_the_readme_table() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    missing = [name for name in OPTIONS if f"| `{name}` |" not in readme]
    assert missing == []


def test_show_config_says_which_options_change_live() -> None:
    import subprocess
    import sys

    shown = subprocess.run(
        [sys.executable, "-m", "singularityd", "--show-config"],
        capture_output=True, text=True, check=True, env={**os.environ, "SING_CONFIG": os.devnull},
    ).stdout  # fmt: skip
    assert "metrics_port = 9470" in shown and "spool = True" in shown
    assert "(changes live on reload)\nlog_level" in shown
    assert "(changes need a restart)\nsocket" in shown


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("metrics_port = 70000\n", "metrics_port must be between 0 and 65535"),
        ("log_level = 'loud'\n", "log_level must be one of debug, info, warning, error"),
        ("metrics = 'perhaps'\n", "not a valid value"),
        ("splice_verdict_seconds = 0\n", "splice_verdict_seconds must be more than 0"),
    ],
)
def test_new_options_are_checked(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path, env={})


def test_spool_folder_defaults_under_the_state_dir(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f"state_dir = '{tmp_path}/state'\n")
    assert load_config(path, env={}).spool_folder == tmp_path / "state" / "spool"
    path.write_text(f"state_dir = '{tmp_path}/state'\nspool_dir = '{tmp_path}/drop'\n")
    assert load_config(path, env={}).spool_folder == tmp_path / "drop"


def test_reload_sorts_live_changes_from_those_needing_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("checkpoint_keep = 2\nproxy_threads = 1\n")
    source = ConfigSource(path, {}, {"log_level": "debug"})
    running = source.load()
    path.write_text("checkpoint_keep = 5\nproxy_threads = 4\nlog_level = 'error'\nadmin_group = 'ops'\n")
    change = reload_config(running, source)
    assert change.applied == {"checkpoint_keep": (2, 5), "admin_group": ("singularity-admin", "ops")}
    assert change.need_restart == {"proxy_threads": (1, 4)}
    assert change.config.checkpoint_keep == 5 and change.config.admin_group == "ops"
    assert change.config.proxy_threads == 1, "a restart option keeps its running value"
    assert change.config.log_level == "debug", "flags keep winning over the file"
    assert change.describe(change.need_restart) == "proxy_threads 1 -> 4"
    assert set(LIVE_OPTIONS) < set(OPTIONS)
    path.write_text("checkpoint_keep = 0\n")
    with pytest.raises(ConfigError, match="checkpoint_keep must be at least 1"):
        reload_config(change.config, source)
    path.write_text("checkpoint_keep = 5\nproxy_threads = 4\nlog_level = 'error'\nadmin_group = 'ops'\n")
    again = reload_config(change.config, source)
    assert again.applied == {} and again.need_restart == {"proxy_threads": (1, 4)}


def test_job_network_must_be_host_or_private(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('job_network = "private"\njob_user_namespaces = false\n')
    config = load_config(path, env={})
    assert (config.job_network, config.job_user_namespaces) == ("private", False)
    path.write_text('job_network = "bridge"\n')
    with pytest.raises(ConfigError, match="job_network must be 'host' or 'private'"):
        load_config(path, env={})
