"""Command-line parameters several `sing` commands share, with the ranges the daemon's API carries
(a number beyond them is a usage error with one line, not a traceback from the wire encoder)."""

from __future__ import annotations

import typer

from singularity.cli.config import settings
from singularity.cli.errors import EXIT_USAGE, CliError

JOB_ID_MIN, JOB_ID_MAX = -(2**63), 2**63 - 1
"""Job ids travel as int64."""
COUNT_MIN, COUNT_MAX = -(2**31), 2**31 - 1
"""Counts (devices, ranks, restarts, lines) and priorities travel as int32."""


def not_empty(value: str | None) -> str | None:
    """Refuse an empty value given for a text parameter (an unset shell variable, often), which the
    daemon would otherwise take for the parameter left out."""
    if value == "":
        raise typer.BadParameter("must not be empty")
    return value


JobIdArgument = typer.Argument(..., metavar="ID", min=JOB_ID_MIN, max=JOB_ID_MAX)
JobIdsArgument = typer.Argument(..., metavar="ID...", min=JOB_ID_MIN, max=JOB_ID_MAX)
SocketOption = typer.Option(None, "--socket", envvar="SING_SOCKET", help="Daemon socket.", callback=not_empty)
OutputOption = typer.Option(
    None, "--output", "-o", help="table (default), wide or json; default from sing.toml's `output`."
)
HeaderOption = typer.Option(
    None, "--header/--no-header", help="Print or omit the header line (default from sing.toml, else print)."
)


def chosen_format(value: str | None, allowed: tuple[str, ...]) -> str:
    """The -o in force: the flag (checked), else sing.toml's `output` where this command has it."""
    choices = ("table", *allowed)
    if value is None:
        configured = settings().output
        return configured if configured in choices else "table"
    if value not in choices:
        raise CliError(f"-o must be one of {', '.join(choices)}, not {value!r}", EXIT_USAGE)
    return value


def chosen_header(flag: bool | None) -> bool:
    """Whether to print header lines: the flag, else sing.toml's `no_header`."""
    return flag if flag is not None else not settings().no_header
