"""What a target checks at PREPARE: can it run this job, and does it see the job's working directory?

The source sends a `MoveSpec` (the PREPARE request's spec_json). The target gathers `HostFacts`
about itself (`gather_host_facts` does the I/O; the daemon adds its devices and whether it is
draining), and `hosting_problem` decides, without I/O, the one-line refusal or '' when it can.
The working directory must be the same one, not merely a directory with the same path: the
source lists some of its entries, and the target must see every one of them.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from singularityd.units import counted, human_bytes

PROBE_ENTRIES = 64
DISK_MARGIN_BYTES = 256 << 20


@dataclass(frozen=True)
class MoveSpec:
    """What a target needs to know to decide whether it can take a job."""

    job_id: str
    user: str
    uid: int
    cwd: str
    gpus: int
    ranks: int
    checkpoint_bytes: int
    cwd_entries: tuple[str, ...] = ()
    jobs_dir: str = ""

    def to_json(self) -> bytes:
        """The PREPARE request's spec_json."""
        return json.dumps(asdict(self), sort_keys=True).encode()

    @staticmethod
    def from_json(data: bytes) -> MoveSpec:
        """Parse spec_json; ValueError with the reason when it is malformed."""
        try:
            raw = json.loads(data)
            return MoveSpec(
                job_id=str(raw["job_id"]),
                user=str(raw["user"]),
                uid=int(raw["uid"]),
                cwd=str(raw["cwd"]),
                gpus=int(raw["gpus"]),
                ranks=int(raw["ranks"]),
                checkpoint_bytes=int(raw["checkpoint_bytes"]),
                cwd_entries=tuple(str(e) for e in raw.get("cwd_entries", ())),
                jobs_dir=str(raw.get("jobs_dir", "")),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"malformed move spec: {e}") from e


def probe_cwd(cwd: str) -> tuple[str, ...]:
    """Names of some entries of the working directory (sorted), for the target to find too."""
    try:
        return tuple(sorted(os.listdir(cwd))[:PROBE_ENTRIES])
    except OSError:
        return ()


@dataclass(frozen=True)
class HostFacts:
    """What this machine offers, gathered for one spec.

    The daemon adds what only it knows: `draining`, `free_devices` (None: not checked), its own
    `jobs_dir`, and `id_taken` (why the job's id is not free here, '' when it is).
    """

    user_uid: int | None
    cwd_is_dir: bool
    cwd_entries_missing: tuple[str, ...]
    devices: int
    free_disk_bytes: int
    checkpoints_available: bool
    draining: bool = False
    free_devices: int | None = None
    jobs_dir: str = ""
    id_taken: str = ""


def gather_host_facts(
    spec: MoveSpec, state_dir: Path, *, devices: int, checkpoints_available: bool
) -> HostFacts:
    """Look the spec's user and working directory up on this machine (blocking I/O)."""
    try:
        uid: int | None = pwd.getpwnam(spec.user).pw_uid
    except KeyError:
        uid = None
    cwd_is_dir = os.path.isdir(spec.cwd)
    missing = (
        tuple(e for e in spec.cwd_entries if not os.path.lexists(os.path.join(spec.cwd, e)))
        if cwd_is_dir
        else ()
    )
    try:
        free = shutil.disk_usage(state_dir).free
    except OSError:
        free = 0
    return HostFacts(uid, cwd_is_dir, missing, devices, free, checkpoints_available)


def hosting_problem(spec: MoveSpec, facts: HostFacts) -> str:
    """Why this machine cannot take the job (one line), or '' when it can."""
    if facts.draining:
        return "this node is draining and takes no jobs"
    if facts.id_taken:
        return facts.id_taken
    if not facts.checkpoints_available:
        return "checkpoints are unavailable on this node, so it cannot restore the job"
    if facts.user_uid is None:
        return f"user {spec.user} does not exist on this node"
    if facts.user_uid != spec.uid:
        return f"user {spec.user} has uid {facts.user_uid} on this node, not {spec.uid}"
    if not facts.cwd_is_dir:
        return f"the job's working directory {spec.cwd} does not exist on this node (it must be shared)"
    if facts.cwd_entries_missing:
        shown = ", ".join(facts.cwd_entries_missing[:3])
        return f"{spec.cwd} on this node is not the job's working directory: it lacks {shown}"
    if spec.jobs_dir and facts.jobs_dir and spec.jobs_dir != facts.jobs_dir:
        return (
            f"this node keeps jobs in {facts.jobs_dir}, not {spec.jobs_dir}: every node must keep "
            "them at the same path (the same state_dir)"
        )
    if spec.gpus > facts.devices:
        return f"the job needs {counted(spec.gpus, 'device')}; this node has {facts.devices}"
    if facts.free_devices is not None and spec.gpus > facts.free_devices:
        needs = counted(spec.gpus, "device")
        return f"no room: the job needs {needs}; {facts.free_devices} of {facts.devices} free"
    if facts.free_disk_bytes < spec.checkpoint_bytes + DISK_MARGIN_BYTES:
        need, free = human_bytes(spec.checkpoint_bytes), human_bytes(facts.free_disk_bytes)
        return f"not enough disk for the checkpoint ({need}; {free} free)"
    return ""
