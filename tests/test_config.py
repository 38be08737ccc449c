"""Configuration: defaults, file, environment and flags, and clear errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from singularityd.config import OPTIONS, Config, ConfigError, load_config


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


def test_job_network_must_be_host_or_private(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('job_network = "private"\njob_user_namespaces = false\n')
    config = load_config(path, env={})
    assert (config.job_network, config.job_user_namespaces) == ("private", False)
    path.write_text('job_network = "bridge"\n')
    with pytest.raises(ConfigError, match="job_network must be 'host' or 'private'"):
        load_config(path, env={})
