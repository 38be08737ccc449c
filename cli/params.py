"""Command-line parameters several `sing` commands share, with the ranges the daemon's API carries
(a number beyond them is a usage error with one line, not a traceback from the wire encoder)."""

from __future__ import annotations

import typer

JOB_ID_MIN, JOB_ID_MAX = -(2**63), 2**63 - 1
"""Job ids travel as int64."""
COUNT_MIN, COUNT_MAX = -(2**31), 2**31 - 1
"""Counts (devices, ranks, restarts, lines) and priorities travel as int32."""

JobIdArgument = typer.Argument(..., metavar="ID", min=JOB_ID_MIN, max=JOB_ID_MAX)
JobIdsArgument = typer.Argument(..., metavar="ID...", min=JOB_ID_MIN, max=JOB_ID_MAX)
