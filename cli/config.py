"""The user's own settings for `sing`: `$XDG_CONFIG_HOME/singularity/sing.toml` (or SING_CLI_CONFIG).

    socket = "/run/singularity/sing.sock"   # the daemon to talk to
    output = "wide"                          # default -o of commands that offer it
    no_header = false                        # default --no-header of commands that print tables
    refresh_seconds = 1.0                    # how often `sing top` refreshes

Flags win over the environment (SING_SOCKET), which wins over this file. A missing file is no
error; a malformed one, or one with an unknown setting, is (so a typo is not silently ignored).
"""

from __future__ import annotations

import functools
import math
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from singularity.cli.errors import EXIT_USAGE, CliError

OUTPUT_FORMATS = ("table", "wide", "json")


@dataclass(frozen=True)
class CliSettings:
    """What the config file sets; None where it says nothing."""

    path: Path
    socket: str | None = None
    output: str | None = None
    no_header: bool = False
    refresh_seconds: float = 1.0


def config_path() -> Path:
    """Where the user's file is: SING_CLI_CONFIG, else under XDG_CONFIG_HOME (default ~/.config)."""
    explicit = os.environ.get("SING_CLI_CONFIG")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "singularity" / "sing.toml"


KNOWN = {"socket": (str,), "output": (str,), "no_header": (bool,), "refresh_seconds": (int, float)}


def parse_settings(path: Path, text: str) -> CliSettings:
    """Settings from the file's text; a CliError naming the file for anything wrong in it."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise CliError(f"{path}: not valid TOML ({error})", EXIT_USAGE) from None
    for key, value in data.items():
        if key not in KNOWN:
            raise CliError(f"{path}: unknown setting {key!r} (known: {', '.join(KNOWN)})", EXIT_USAGE)
        kinds = KNOWN[key]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise CliError(f"{path}: {key} must be a {kinds[-1].__name__}, not {value!r}", EXIT_USAGE)
    output = data.get("output")
    if output is not None and output not in OUTPUT_FORMATS:
        choices = ", ".join(OUTPUT_FORMATS)
        raise CliError(f"{path}: output must be one of {choices}, not {output!r}", EXIT_USAGE)
    refresh = float(data.get("refresh_seconds", 1.0))
    if not (math.isfinite(refresh) and refresh >= 0.1):
        raise CliError(f"{path}: refresh_seconds must be at least 0.1, not {refresh:g}", EXIT_USAGE)
    return CliSettings(
        path=path,
        socket=data.get("socket") or None,
        output=output,
        no_header=bool(data.get("no_header", False)),
        refresh_seconds=refresh,
    )


@functools.cache
def settings() -> CliSettings:
    """The user's settings, read once per run (defaults when there is no file)."""
    path = config_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return CliSettings(path=path)
    except OSError as error:
        raise CliError(f"{path}: cannot read it ({error.strerror})", EXIT_USAGE) from None
    return parse_settings(path, text)
