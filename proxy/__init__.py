"""The device proxy: a server per device and the in-job client that forwards device work to it."""

from __future__ import annotations

import pathlib


def bootstrap_path() -> pathlib.Path:
    """Directory the launcher puts first on a job's PYTHONPATH to activate the in-job client."""
    return pathlib.Path(__file__).resolve().parent / "bootstrap"
