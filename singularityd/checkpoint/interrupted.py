"""Settling a checkpoint whose daemon died in the middle of a dump that stops the job.

CRIU runs in a session of its own, so it outlives a killed daemon: the dump goes on, and when it
succeeds CRIU kills the job's processes as asked. Without the manifest the daemon would have
written next, the job would look lost. At the next start, `settle_interrupted` waits for such a
CRIU to end, then records the checkpoint from the intent stored before the dump if CRIU finished
it (the job is stopped with that checkpoint), or removes the incomplete folder (CRIU resumed the
processes on failure, or never started: they still run and are re-adopted). A checkpoint in place
whose images were staged in memory and not yet on disk (checkpoint.staging) is removed likewise:
the job ran on, and the images in memory went with the staging folder the daemon had then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from singularityd.checkpoint.dump_script import dump_files, parse_sizes
from singularityd.checkpoint.service import Checkpointer
from singularityd.checkpoint.staging import staged_folder
from singularityd.checkpoint.store import PendingCheckpoint

log = logging.getLogger(__name__)

DUMP_FINISHED = "Dumping finished successfully"
"""What CRIU's dump log says last when the images are complete (and a stopped tree killed)."""
CRIU_WAIT_S = 300.0


def criu_dumping_into(images: Path) -> list[int]:
    """PIDs of CRIU processes still dumping into `images` (their command line names it)."""
    wanted = os.fsencode(str(images))
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            args = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            if b"dump" in args and wanted in args:
                found.append(int(entry))
    return found


async def criu_done_with(images: Path, wait_s: float) -> bool:
    """Wait until no CRIU dumps into `images`; False if one still does after `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while await asyncio.to_thread(criu_dumping_into, images):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


def dump_finished(log_file: Path) -> bool:
    """Whether CRIU's log of a dump says it completed."""
    try:
        return DUMP_FINISHED in log_file.read_text(errors="replace")
    except OSError:
        return False


async def settle_interrupted(checkpointer: Checkpointer, job_id: str, wait_s: float = CRIU_WAIT_S) -> str:
    """Finish or remove the checkpoint a dead daemon left half-recorded; what happened ('' if none)."""
    store = checkpointer.store
    with store.locked(job_id):
        staged = await asyncio.to_thread(store.cut_short_staged, job_id)
        if staged is not None:
            return await _remove_staged(staged, store.trusted_uid, wait_s)
        found = await asyncio.to_thread(store.interrupted, job_id)
        if found is None:
            return ""
        pending, intent = found
        if not await criu_done_with(pending.images, wait_s):
            return f"checkpoint {pending.seq} is still being dumped by CRIU after {wait_s:.0f}s; left alone"
        dump_log, script, sizes_file, in_flight = dump_files(store.logs_dir(job_id), pending.seq)
        try:
            if not await asyncio.to_thread(dump_finished, dump_log):
                await asyncio.to_thread(store.abort, pending)
                why = "was cut short by a daemon restart before CRIU completed it; removed"
                return f"checkpoint {pending.seq} {why}"
            return await asyncio.to_thread(_record, checkpointer, pending, intent, sizes_file)
        finally:
            for leftover in (script, sizes_file, in_flight):
                with contextlib.suppress(FileNotFoundError):
                    leftover.unlink()


async def _remove_staged(pending: PendingCheckpoint, trusted_uid: int, wait_s: float) -> str:
    """Remove a checkpoint in place whose images were still in memory or on their way to disk when
    its daemon died (the job ran on through it), once no CRIU dumps into its staging folder."""
    folder = await asyncio.to_thread(staged_folder, pending.path, trusted_uid)
    if folder is not None:
        if not await criu_done_with(folder, wait_s):
            return f"checkpoint {pending.seq} is still dumped by CRIU after {wait_s:.0f}s; left alone"
        await asyncio.to_thread(shutil.rmtree, folder, True)
    await asyncio.to_thread(shutil.rmtree, pending.path, True)
    note = (
        f"checkpoint {pending.seq} was being moved from memory to disk when the daemon stopped; "
        "removed incomplete (the job ran on)"
    )
    log.warning("job %s: %s", pending.job_id, note)
    return note


def _record(
    checkpointer: Checkpointer, pending: PendingCheckpoint, intent: dict[str, Any], sizes: Path
) -> str:
    """Write the manifest of a dump CRIU completed after its daemon died."""
    rewind_paths = [str(p) for p in intent.get("rewind_paths") or []]
    rewind_sizes: dict[str, int] = {}
    if rewind_paths:  # without them the logs are as CRIU left them: the tree died right after the dump
        with contextlib.suppress(OSError):
            rewind_sizes = parse_sizes(rewind_paths, sizes.read_text())
    note = f"checkpoint {pending.seq}: CRIU finished the dump after the daemon died; recorded at restart"
    checkpointer.store.finish(
        pending,
        leave_running=False,
        criu_version=str(intent.get("criu_version", "")),
        pre_dumps=[str(p) for p in intent.get("pre_dumps") or []],
        external_unix_inodes=[int(i) for i in intent.get("external_unix_inodes") or []],
        external_mounts=intent.get("external_mounts"),
        rewind_sizes=rewind_sizes,
        stats={"recorded_after_restart": True},
        extra=intent.get("extra"),
    )
    log.warning("job %s: %s", pending.job_id, note)
    return note
