"""Generated stubs match the proto, and the CLI stays free of heavy UI imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from singularityd.api.generate import generate
from tests.helpers import REPO

GENERATED = ("singularity_pb2.py", "singularity_pb2.pyi", "singularity_pb2_grpc.py")


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    generate(tmp_path)
    for name in GENERATED:
        fresh = (tmp_path / "singularityd" / "api" / "v1" / name).read_text()
        committed = (REPO / "singularityd" / "api" / "v1" / name).read_text()
        assert fresh == committed, f"{name} is stale: run python -m singularityd.api.generate"


def test_cli_never_imports_textual_or_torch() -> None:
    code = (
        "import sys, singularity.cli.main; "
        "bad = [m for m in ('textual', 'torch', 'rich') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


def test_systemd_unit_keeps_jobs_through_restarts() -> None:
    from singularityd.config import Config

    unit = (REPO / "systemd" / "singularityd.service").read_text()
    settings = dict(
        line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#")
    )
    assert settings["Type"] == "notify"
    assert settings["KillMode"] == "process"
    assert settings["RuntimeDirectory"] == "singularity" and settings["StateDirectory"] == "singularity"
    assert settings["Restart"] == "on-failure"
    assert settings["ExecReload"] == "/bin/kill -HUP $MAINPID", "systemctl reload reads the config again"
    default_grace = Config.__dataclass_fields__["shutdown_grace_seconds"].default
    assert isinstance(default_grace, float)
    assert float(settings["TimeoutStopSec"]) > default_grace
