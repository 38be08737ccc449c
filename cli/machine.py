"""`sing`'s verbs about the machine rather than a job: its devices (`devices`), a live view
(`top`, which alone imports textual, and only when run) and a check of the set-up (`doctor`)."""

from __future__ import annotations

import math
import os
import pwd
import stat
import sys
from typing import Any, NoReturn

import typer

from singularity.cli import output
from singularity.cli.client import connect, resolve_socket, unreachable_message
from singularity.cli.config import settings
from singularity.cli.errors import EXIT_FAILURE, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, CliError
from singularity.cli.params import HeaderOption, OutputOption, SocketOption, chosen_format, chosen_header
from singularityd.api.v1 import singularity_pb2 as pb


def devices(
    output_format: str = OutputOption,
    header: bool = HeaderOption,
    socket: str = SocketOption,
) -> None:
    """List the devices the daemon owns, their proxies and the jobs on them."""
    fmt = chosen_format(output_format, ("wide", "json"))
    with connect(socket) as stub:
        found = stub.ListDevices(pb.ListDevicesRequest()).devices
    if fmt == "json":
        print(output.to_json([output.device_dict(d) for d in found]))
    else:
        text = output.devices_table(found, wide=fmt == "wide", header=chosen_header(header))
        if text:
            print(text)


def top(
    all_jobs: bool = typer.Option(False, "--all", "-a", help="Include ended jobs."),
    interval: float = typer.Option(
        None,
        "--interval",
        "-n",
        help="Seconds between refreshes (default: sing.toml's refresh_seconds, else 1).",
    ),
    socket: str = SocketOption,
) -> None:
    """A live view of devices and jobs, with actions (preempt, suspend, resume, cancel, checkpoint)."""
    refresh = interval if interval is not None else settings().refresh_seconds
    if not (math.isfinite(refresh) and refresh >= 0.1):
        raise CliError(f"--interval must be at least 0.1 seconds, not {refresh:g}", EXIT_USAGE)
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise CliError("sing top needs a terminal (for scripts: sing ps -o json, sing ps -w)", EXIT_USAGE)
    path = resolve_socket(socket)
    if not path.exists():
        raise CliError(unreachable_message(path), EXIT_UNAVAILABLE)
    try:
        from singularity.cli.top.app import TopApp
    except ImportError as error:
        raise CliError(f"sing top needs textual ({error}): pip install 'singularityd[tui]'") from None
    from singularity.cli.source import DaemonSource

    source = DaemonSource(path)
    try:
        TopApp(source, refresh_seconds=refresh, all_jobs=all_jobs).run()
    finally:
        source.close()


class _Checks:
    """The findings of `sing doctor`, printed as they come (text) or at the end (JSON)."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.found: list[dict[str, str]] = []
        self.healthy = True

    def add(self, status: str, label: str, detail: str) -> bool:
        """Record one finding ("ok", "FAIL" or "info"); whether it is not a failure."""
        self.found.append({"check": label, "status": status, "detail": detail})
        self.healthy &= status != "FAIL"
        if not self.as_json:
            print(f"[{status}] {label}: {detail}")
        return status != "FAIL"

    def check(self, ok: bool, label: str, detail: str) -> bool:
        """An ok-or-FAIL finding."""
        return self.add("ok" if ok else "FAIL", label, detail)

    def finish(self, code: int | None = None) -> NoReturn:
        """Print the JSON form if asked and exit: the given code, else 0 when healthy, else 1."""
        if self.as_json:
            print(output.to_json(self.found))
        raise SystemExit(code if code is not None else EXIT_OK if self.healthy else EXIT_FAILURE)


def doctor(
    output_format: str = typer.Option(None, "--output", "-o", help="json: the findings as JSON."),
    socket: str = SocketOption,
) -> None:
    """Check the set-up: daemon reachable, socket permissions, CRIU, NVML."""
    if output_format not in (None, "json"):
        raise CliError(f"-o must be json, not {output_format!r}", EXIT_USAGE)
    checks = _Checks(output_format == "json")
    path = resolve_socket(socket)
    try:
        found = path.stat()
        mode = found.st_mode
        try:
            owner = pwd.getpwuid(found.st_uid).pw_name
        except KeyError:
            owner = str(found.st_uid)
        usable = stat.S_ISSOCK(mode) and os.access(path, os.R_OK | os.W_OK)
        checks.check(
            usable,
            "socket",
            f"{path} ({stat.filemode(mode)}, owner {owner})" + ("" if usable else ": not usable by you"),
        )
    except FileNotFoundError:
        checks.check(False, "socket", unreachable_message(path))
        checks.finish(EXIT_UNAVAILABLE)
    except OSError as error:
        checks.check(False, "socket", f"{path}: {error.strerror}")
        checks.finish(EXIT_UNAVAILABLE)
    try:
        with connect(socket) as stub:
            info = stub.GetDaemonInfo(pb.DaemonInfoRequest())
    except CliError as error:
        checks.check(False, "daemon", error.message)
        checks.finish(error.code)
    checks.check(True, "daemon", f"singularityd {info.version} ({info.mode} mode), state in {info.state_dir}")
    checks.check(
        True,
        "identity",
        f"you are {info.caller_user} (uid {info.caller_uid})"
        + (", an admin" if info.caller_is_admin else ""),
    )
    checks.check(True, "devices", f"{info.device_count} {info.device_kind} device(s)")
    nvml_ok = info.device_kind == "nvml" or not info.nvml_status.startswith("unavailable")
    checks.add("ok" if nvml_ok else "info", "nvml", info.nvml_status)
    criu_ok = not info.criu_unavailable_reason
    checks.check(
        criu_ok,
        "criu",
        f"CRIU {info.criu_version} at {info.criu_path}"
        if criu_ok
        else f"checkpoints unavailable: {info.criu_unavailable_reason}",
    )
    if criu_ok and info.mode == "system":
        checks.check(
            not info.restore_guard_problem,
            "restore guard",
            "CRIU restores other users' jobs with their rights"
            if not info.restore_guard_problem
            else f"CRIU would restore other users' jobs with root's rights by path: "
            f"{info.restore_guard_problem}; install a C compiler and restart the daemon",
        )
    checks.check(
        info.pid_namespaces or info.mode == "user",
        "isolation",
        "jobs run in their own PID namespace" if info.pid_namespaces else "no PID namespaces (user mode)",
    )
    checks.finish()


def register(app: Any) -> None:
    """Add the machine's verbs to the `sing` application."""
    app.command()(devices)
    app.command()(top)
    app.command()(doctor)
