"""Checkpoints of job process trees with CRIU: driver, image store, and the checkpointer.

The daemon itself goes through singularityd.checkpoint.coordinator, which adds the job's device
state (saved and restored by the device proxies) to what is exported here. Typical use:

    info = locate_criu(config.criu)            # once at start-up; CheckpointUnavailable says why not
    cp = Checkpointer(Criu(info), ImageStore(state_dir / "checkpoints"), keep=3, pre_copy=1)
    result = await cp.checkpoint(job_id, init_pid, owner_uid=uid, owner_gid=gid,
                                 leave_running=False, rewind_paths=log_paths)
    restored = await cp.restore_latest(job_id)  # restored.pid, restored.skipped
"""

from singularityd.checkpoint.criu import Criu, CriuOptions, DumpStats, RestoreOutcome
from singularityd.checkpoint.criu_discovery import CriuInfo, locate_criu
from singularityd.checkpoint.errors import (
    CheckpointError,
    CheckpointUnavailable,
    CriuError,
    NoValidCheckpoint,
)
from singularityd.checkpoint.manifest import FileRecord, Manifest, Skipped, Verdict
from singularityd.checkpoint.precheck import dump_problems, tree_pids
from singularityd.checkpoint.restoring import RestoreResult
from singularityd.checkpoint.service import Checkpointer, CheckpointResult
from singularityd.checkpoint.store import ImageStore, JobUsage, rewind_files

__all__ = [
    "CheckpointError",
    "CheckpointResult",
    "CheckpointUnavailable",
    "Checkpointer",
    "Criu",
    "CriuError",
    "CriuInfo",
    "CriuOptions",
    "DumpStats",
    "FileRecord",
    "ImageStore",
    "JobUsage",
    "Manifest",
    "NoValidCheckpoint",
    "RestoreOutcome",
    "RestoreResult",
    "Skipped",
    "Verdict",
    "dump_problems",
    "locate_criu",
    "rewind_files",
    "tree_pids",
]
