"""Generated stubs match the proto, and the CLI stays free of heavy UI imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from singularityd.api.generate import generate
from tests.helpers import REPO

GENERATED = ("singularity_pb2.py", "singularity_pb2.pyi", "singularity_pb2_grpc.py")


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    generate(tmp_path)
    for name in GENERATED:
        fresh = (tmp_path / "singularityd" / "api" / "v1" / name).read_text()
        committed = (REPO / "singularityd" / "api" / "v1" / name).read_text()
        assert fresh == committed, f"{name} is stale: run python -m singularityd.api.generate"


CLI_MAY_IMPORT_FROM_THE_DAEMON = {
    "singularityd",
    "singularityd.api",
    "singularityd.api.v1",
    "singularityd.api.v1.singularity_pb2",
    "singularityd.api.v1.singularity_pb2_grpc",
    "singularityd.tiers",
    "singularityd.units",
}


def imported_by(*args: str) -> set[str]:
    """Every module a run of `sing ARGS` imports (from python -X importtime)."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "singularity.cli.main", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "SING_SOCKET": "/nonexistent/sing.sock"},
    )
    modules = set()
    for line in result.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            modules.add(line.rsplit("|", 1)[1].strip())
    assert "singularity.cli.client" in modules, result.stderr[-2000:]
    return modules


def heavy(modules: set[str]) -> list[str]:
    """The modules `sing` must never load outside `sing top`: UI, torch, the daemon itself."""
    return sorted(
        m
        for m in modules
        if m.split(".")[0] in ("textual", "torch", "rich", "numpy")
        or (m.startswith("singularityd") and m not in CLI_MAY_IMPORT_FROM_THE_DAEMON)
    )


@pytest.mark.parametrize(
    "args", [["--version"], ["ps"], ["show", "1"], ["logs", "-f", "1"], ["top", "--help"]]
)
def test_cli_never_imports_textual_torch_or_the_daemon(args: list[str]) -> None:
    assert heavy(imported_by(*args)) == []


def test_top_imports_textual_but_not_torch_or_the_daemon() -> None:
    code = "import sys, json, singularity.cli.top.app; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    modules = set(json.loads(result.stdout))
    assert "textual" in modules
    assert [m for m in heavy(modules) if m.split(".")[0] not in ("textual", "rich")] == []


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
