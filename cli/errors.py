"""The one place that owns stderr and exit codes for `sing`.

Exit codes (documented in the README):
  0  success
  1  failure: an unexpected error, or `doctor` found a problem
  2  invalid usage or request (bad flag, empty command, zero or negative counts)
  3  singularityd cannot be reached (not running, wrong socket, no permission)
  4  no such job
  5  permission denied (the job belongs to another user)
  6  the request cannot be satisfied now or here (more devices than the machine has, the job
     is in the wrong state)
`sing wait` and `sing submit --wait` exit with the job's own status instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import grpc

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_NOT_FOUND = 4
EXIT_PERMISSION = 5
EXIT_CONFLICT = 6
EXIT_INTERRUPTED = 130
"""Ctrl-C of a command that follows something (`logs -f`, `ps -w`), as a shell reports SIGINT."""

STATUS_EXIT_CODES: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: EXIT_USAGE,
    grpc.StatusCode.UNAVAILABLE: EXIT_UNAVAILABLE,
    grpc.StatusCode.NOT_FOUND: EXIT_NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED: EXIT_PERMISSION,
    grpc.StatusCode.FAILED_PRECONDITION: EXIT_CONFLICT,
    grpc.StatusCode.RESOURCE_EXHAUSTED: EXIT_CONFLICT,
    grpc.StatusCode.OUT_OF_RANGE: EXIT_USAGE,
}


class CliError(Exception):
    """An error to report on one line with a given exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def exit_code_for_status(code: grpc.StatusCode | int) -> int:
    """The exit code for a gRPC status (given as the enum or its integer value)."""
    if isinstance(code, int):
        matches = [status for status in grpc.StatusCode if status.value[0] == code]
        if not matches:
            return EXIT_FAILURE
        code = matches[0]
    return STATUS_EXIT_CODES.get(code, EXIT_FAILURE)


def warn(message: str) -> None:
    """One line on stderr, prefixed with the program name."""
    print(f"sing: {message}", file=sys.stderr, flush=True)


def exit_interrupted() -> NoReturn:
    """End a follower stopped by Ctrl-C with 130 at once: what it printed is flushed, and the
    interpreter's own exit, which would close a gRPC stream cut mid-read, is skipped (it could hang
    there, and the follower with it)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(EXIT_INTERRUPTED)


@contextlib.contextmanager
def stopped_by_ctrl_c(stop: Callable[[], Any]) -> Iterator[list[bool]]:
    """While inside, Ctrl-C calls `stop` (which ends a stream being read) and is noted in the list
    yielded, instead of raising KeyboardInterrupt in the middle of gRPC's reading, whose cut
    stream could then hang the exit."""
    interrupted: list[bool] = []

    def on_sigint(signum: int, frame: Any) -> None:
        interrupted.append(True)
        stop()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def fail(message: str, code: int = EXIT_FAILURE) -> NoReturn:
    """Report an error on stderr and exit with the given code."""
    warn(message)
    raise SystemExit(code)
