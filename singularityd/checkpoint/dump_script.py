"""The action script of a checkpoint's final dump, which CRIU runs while the tree is still frozen.

After the dump (`post-dump`) it records the sizes of the job's append-only logs, so a restore can
cut them back to what the images saw, and, for a dump that stops the job without CRIU's network
lock, fails when the images hold an established TCP connection: CRIU then lets the tree run on
instead of killing it, and the checkpointer dumps it again under the lock (Checkpointer._dump).
"""

from __future__ import annotations

import contextlib
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from singularityd.checkpoint import image_files
from singularityd.checkpoint.image_files import FILES_IN_FLIGHT_EXIT

TCP_STREAM_IMAGES = "tcp-stream-*.img"
"""CRIU's image of an established TCP connection: one may not appear in a dump without the lock."""
TCP_REFUSED_EXIT = 75
"""How the action script of a dump without the network lock fails when the dump holds a TCP connection."""


def post_dump_script(
    paths: Sequence[str],
    out: Path,
    refuse_tcp_in: Path | None = None,
    copies: Sequence[str] = (),
    *,
    images: Path,
    in_flight_out: Path,
) -> str:
    """A CRIU action script that fails if the `images` hold a file in flight in a socket queue
    (its paths into `in_flight_out`: see image_files), then records the sizes of `paths` while the
    tree is still frozen and runs the shell lines `copies` (shm.prepare_copies); with
    `refuse_tcp_in` (a dump without the network lock) it first fails if that images folder holds
    an established TCP connection. CRIU lets the tree run on when it fails, instead of killing it."""
    lines = [f"stat -L -c %s -- {shlex.quote(p)} 2>/dev/null || echo -1" for p in paths]
    body = "\n".join(lines) or ":"
    refuse = ""
    if refuse_tcp_in is not None:
        found = f"{shlex.quote(str(refuse_tcp_in))}/{TCP_STREAM_IMAGES}"
        refuse = f'for image in {found}; do [ -e "$image" ] && exit {TCP_REFUSED_EXIT}; done\n'
    scan = " ".join(shlex.quote(str(part)) for part in (sys.executable, "-S", image_files.__file__, images))
    queues = shlex.quote(str(images / image_files.SOCKET_QUEUES))
    refuse += (
        f"[ ! -e {queues} ] || {scan} > {shlex.quote(str(in_flight_out))} || exit {FILES_IN_FLIGHT_EXIT}\n"
    )
    return (
        "#!/bin/sh\n"
        '[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0\n'
        f"{refuse}"
        f"{{\n{body}\n}} > {shlex.quote(str(out))}\n" + "".join(f"{line}\n" for line in copies) + "exit 0\n"
    )


def dump_files(logs: Path, seq: int) -> tuple[Path, Path, Path, Path]:
    """The final dump of checkpoint `seq`: CRIU's log, its action script, the sizes it records, the
    files in flight it found."""
    tag = f"{seq:08d}"
    return (
        logs / f"dump-{tag}.log",
        logs / f"post-dump-{tag}.sh",
        logs / f"sizes-{tag}.txt",
        logs / f"in-flight-{tag}.txt",
    )


FAILED_LOGS_KEPT = 5
"""The CRIU logs of a job's failed dumps kept (the newest), beside those of its checkpoints."""


def keep_failed_log(log: Path) -> Path:
    """Move a failed dump's CRIU log aside (the number of a failed checkpoint is used again by the
    next one, whose log would overwrite it) and drop all but the newest FAILED_LOGS_KEPT such logs;
    the path it now has, or `log` if it could not move."""
    kept = log.with_name(f"{log.stem}-failed-{time.strftime('%Y%m%dT%H%M%S')}{log.suffix}")
    try:
        log.rename(kept)
    except OSError:
        return log
    failed = sorted(log.parent.glob("*-failed-*.log"), key=_modified, reverse=True)
    for old in failed[FAILED_LOGS_KEPT:]:
        with contextlib.suppress(FileNotFoundError):
            old.unlink()
    return kept


def _modified(path: Path) -> float:
    """A file's modification time (0 for one gone meanwhile)."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def parse_sizes(paths: Sequence[str], text: str) -> dict[str, int]:
    """Pair the action script's output lines with the paths it was given."""
    values = text.split()
    if len(values) != len(paths):
        return {}
    return {p: int(v) for p, v in zip(paths, values, strict=True) if v.lstrip("-").isdigit()}
