"""What travels with a job to a peer, and where it lands: blocking file work for `moves` and `arrivals`.

A move sends one directory (`transfer` streams it):

    job.json                 the job's record and event log (store.export_job), its checkpoint's seq
    checkpoint/<seq>/        the checkpoint folder as the image store keeps it (CRIU images, the
                             proxies' device-state files under images/proxy/, manifest.json)
    logs/rank-<r>.log        the job's output, as it was when the job stopped
    supervisor.log
    base/, delta/            with a base of the process images: see `bases`
    precopy-owner.json       sent with the device state pre-copied while the job runs: whom the
                             target's proxies run as when they preload it (before job.json arrives)

The source builds it from hard links (the checkpoint's files never change once written), so
staging costs no copy. The target puts each part where its own daemon keeps it: the checkpoint
into its image store, the logs into the job's folder (which is at the same path on every node).
Beside the image store's jobs, a leaving job is staged under `.outgoing/<id>@<epoch>` and an arriving
one received under `.incoming/<id>@<epoch>`; `delete_local_copy` removes all a node keeps of a job
that no longer runs there. Call everything here from a thread.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from singularityd.checkpoint.manifest import IMAGES_DIR
from singularityd.checkpoint.store import ImageStore
from singularityd.devices.proxy_servers import PROXY_DIR
from singularityd.federation import netlock
from singularityd.jobs.launch import prepare_job_dir
from singularityd.jobs.paths import JobPaths

JOB_FILE = "job.json"
CHECKPOINT_DIR = "checkpoint"
LOGS_DIR = "logs"
SUPERVISOR_LOG = "supervisor.log"
INCOMING_DIR = ".incoming"
"""Under the image store's root: where arriving jobs' files are received, a folder per epoch."""
OUTGOING_DIR = ".outgoing"
"""Under the image store's root: where leaving jobs' files are staged (hard links), a folder per epoch."""
PRECOPY_OWNER_FILE = "precopy-owner.json"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Arrival:
    """What a received directory holds: the job's exported record and its checkpoint's seq."""

    exported: dict[str, Any]
    seq: int | None

    @property
    def job_id(self) -> int:
        """The job's id (the same on every node)."""
        return int(self.exported["job"]["id"])

    @property
    def uid(self) -> int:
        """The job's user."""
        return int(self.exported["job"]["uid"])

    @property
    def gid(self) -> int:
        """The job's group."""
        return int(self.exported["job"]["gid"])

    @property
    def gpus(self) -> int:
        """How many devices the job holds when it runs."""
        return int(self.exported["job"]["gpus"])


def link_or_copy(source: Path, target: Path) -> None:
    """Hard-link a file (a copy where the two folders are on different filesystems)."""
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError as error:
        if error.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        shutil.copy2(source, target, follow_symlinks=False)


def _mirror(source: Path, target: Path) -> None:
    """Recreate a folder tree under `target`: files hard-linked, symbolic links as they are."""
    for folder, dirs, files in os.walk(source):
        relative = Path(folder).relative_to(source)
        (target / relative).mkdir(parents=True, exist_ok=True, mode=0o700)
        for name in (*files, *(d for d in dirs if (Path(folder) / d).is_symlink())):
            path = Path(folder) / name
            if path.is_symlink():
                os.symlink(os.readlink(path), target / relative / name)
            else:
                link_or_copy(path, target / relative / name)


def remove(path: Path) -> None:
    """Delete a folder or file if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def stage_outgoing(
    staging: Path, exported: dict[str, Any], checkpoint: Path | None, seq: int | None, paths: JobPaths
) -> None:
    """Build the directory to send (afresh): the record, the checkpoint folder, the logs."""
    remove(staging)
    staging.mkdir(parents=True, mode=0o700)
    if checkpoint is not None and seq is not None:
        _mirror(checkpoint, staging / CHECKPOINT_DIR / str(seq))
    (staging / LOGS_DIR).mkdir(mode=0o700)
    if paths.logs.is_dir():
        for rank_log in sorted(paths.logs.iterdir()):
            if rank_log.is_file() and not rank_log.is_symlink():
                shutil.copyfile(rank_log, staging / LOGS_DIR / rank_log.name)
    if paths.supervisor_log.is_file():
        shutil.copyfile(paths.supervisor_log, staging / SUPERVISOR_LOG)
    document = {"record": exported, "checkpoint_seq": seq}
    (staging / JOB_FILE).write_text(json.dumps(document, sort_keys=True))


def stage_pre_copy(staging: Path, images: Path, seq: int) -> None:
    """Build (afresh) the part of the directory to send that a checkpoint's device-state files
    make while the job still runs, at the paths the whole one will have (see `stage_outgoing`)."""
    remove(staging)
    staging.mkdir(parents=True, mode=0o700)
    if (images / PROXY_DIR).is_dir():
        _mirror(images / PROXY_DIR, staging / CHECKPOINT_DIR / str(seq) / IMAGES_DIR / PROXY_DIR)


@dataclass(frozen=True)
class PreCopied:
    """The device state of an arriving job that came while it still ran: its images folder (the
    device-state files with their pre-copied records) and whom its proxies run as."""

    images: Path
    devices: int
    user: str
    uid: int
    gid: int


def stage_precopy_owner(staging: Path, user: str, uid: int, gid: int) -> None:
    """Say, with the pre-copied device state, whom the target's proxies preloading it run as."""
    (staging / PRECOPY_OWNER_FILE).write_text(json.dumps({"user": user, "uid": uid, "gid": gid}))


def pre_copied(incoming: Path) -> PreCopied | None:
    """The pre-copied device state received in `incoming`, while only it has arrived (None once the
    whole job has, or when there is none or it is unusable)."""
    if (incoming / JOB_FILE).exists():
        return None
    try:
        owner = json.loads((incoming / PRECOPY_OWNER_FILE).read_text())
        user, uid, gid = str(owner["user"]), int(owner["uid"]), int(owner["gid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for images in sorted((incoming / CHECKPOINT_DIR).glob(f"*/{IMAGES_DIR}")):
        devices = len(list((images / PROXY_DIR).glob("cuda*.state")))
        if devices:
            return PreCopied(images, devices, user, uid, gid)
    return None


def read_arrival(incoming: Path) -> Arrival:
    """The record and checkpoint seq of a received directory (ValueError when it is malformed)."""
    try:
        document = json.loads((incoming / JOB_FILE).read_text())
        seq = document.get("checkpoint_seq")
        arrival = Arrival(document["record"], int(seq) if seq is not None else None)
        _ = (arrival.job_id, arrival.uid, arrival.gid, arrival.gpus)  # each must parse
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"the received job record is unusable: {error}") from error
    return arrival


def place_arrival(incoming: Path, arrival: Arrival, images: ImageStore, paths: JobPaths) -> None:
    """Put a received job where this daemon keeps it: its checkpoint in the image store (replacing
    any this node kept of it), its logs in the job's folder, owned by the job's user."""
    job = str(arrival.job_id)
    for seq in images.seqs(job):
        remove(images.checkpoint_dir(job, seq))
    if arrival.seq is not None:
        folder = images.checkpoint_dir(job, arrival.seq)
        folder.parent.mkdir(parents=True, exist_ok=True, mode=0o711)
        os.replace(incoming / CHECKPOINT_DIR / str(arrival.seq), folder)
        os.chown(folder, arrival.uid, arrival.gid)
        os.chmod(folder, 0o700)
    prepare_job_dir(paths)
    for stale in (paths.status, paths.pid):
        stale.unlink(missing_ok=True)
    received = [(each, paths.logs / each.name) for each in sorted((incoming / LOGS_DIR).glob("*"))]
    if (incoming / SUPERVISOR_LOG).exists():
        received.append((incoming / SUPERVISOR_LOG, paths.supervisor_log))
    for source, target in received:
        shutil.move(source, target)
        if os.geteuid() == 0:
            os.chown(target, arrival.uid, arrival.gid)
        os.chmod(target, 0o600)


def delete_local_copy(images: ImageStore, job_root: Path, job_id: int) -> None:
    """Remove a job's checkpoints, the network lock of its last dump, its folder (`job_root`) and
    what was staged to send of it from this node (it does not run here)."""
    checkpoints = images.job_dir(str(job_id))
    for table in netlock.lock_table_names(checkpoints) if checkpoints.is_dir() else []:
        try:
            if netlock.delete_inet_table(table):
                log.info("job %s: network lock %s of its last dump deleted", job_id, table)
        except OSError as error:
            log.warning("job %s: cannot delete network lock %s: %s", job_id, table, error)
    remove(checkpoints)
    remove(job_root)
    for staged in (images.root / OUTGOING_DIR).glob(f"{job_id}@*"):
        remove(staged)


def remove_leftovers(root: Path, arriving: Callable[[str, int], bool]) -> list[tuple[Path, int]]:
    """At start, delete what moves cut short by the daemon's end left under the image store's
    `root`: every folder staged to send (what it was staged for ended with the daemon) and every
    received folder but those of epochs still `arriving(job_id, epoch)`. What went, with its bytes."""
    removed = []
    staged = sorted((root / OUTGOING_DIR).glob("*"))
    received = [
        folder
        for folder in sorted((root / INCOMING_DIR).glob("*"))
        if not _is_arriving(folder.name, arriving)
    ]
    for leftover in (*staged, *received):
        size = sum(f.stat().st_size for f in leftover.rglob("*") if f.is_file() and not f.is_symlink())
        remove(leftover)
        removed.append((leftover, size))
    return removed


def _is_arriving(name: str, arriving: Callable[[str, int], bool]) -> bool:
    job_id, _, epoch = name.partition("@")
    return epoch.isdigit() and arriving(job_id, int(epoch))
