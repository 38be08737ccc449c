"""Long work on a job's processes (launch, restore, checkpoint), run by the daemon as tasks.

Each returns the stimulus that reports its outcome instead of acting on it: the daemon feeds that
stimulus to the state machine, which decides what the outcome means (as dask's workers report
finished tasks back to their state machine).
"""

from __future__ import annotations

from singularityd.checkpoint.errors import CheckpointError, JobEnded, NoValidCheckpoint
from singularityd.checkpoint.interface import Checkpoints, CheckpointTaken, CheckpointTarget, PauseHooks
from singularityd.core.actions import TakeCheckpoint
from singularityd.core.lost_processes import StopPurpose
from singularityd.core.stimuli import (
    Checkpointed,
    CheckpointFailed,
    LaunchFailed,
    ProcessesRunning,
    Restored,
    RestoreFailed,
)
from singularityd.devices.access import DeviceAccess, DeviceError
from singularityd.devices.proxy_servers import JobIdentity
from singularityd.devices.splicing import logical_devices
from singularityd.errors import StateConflict
from singularityd.jobs.launch import LaunchError, user_groups
from singularityd.jobs.processes import Processes, ProcessId
from singularityd.store import JobRecord


def identity(job: JobRecord) -> JobIdentity:
    """Whom the job's device work runs as: its user, with the user's groups."""
    return JobIdentity(job.spec.uid, job.spec.gid, tuple(user_groups(job.spec.user, job.spec.gid)))


async def launch(
    job: JobRecord, processes: Processes, devices: DeviceAccess
) -> ProcessesRunning | LaunchFailed:
    """Start the job's processes on its devices."""
    try:
        logical = logical_devices(job.spec.ranks, job.spec.gpus)
        await devices.admit(job.id, identity(job), job.devices, logical)
        device_env = devices.environment(job.id, job.devices, job.spec.env.get("PYTHONPATH"), logical)
        process = await processes.launch(job, device_env)
    except (LaunchError, DeviceError) as error:
        return LaunchFailed(str(error))
    return ProcessesRunning(process.pid, process.start_ticks)


async def restore(
    job: JobRecord, processes: Processes, checkpoints: Checkpoints, devices: DeviceAccess
) -> Restored | RestoreFailed:
    """Restore the job's processes from its newest good checkpoint onto its devices."""
    try:
        logical = logical_devices(job.spec.ranks, job.spec.gpus)
        await devices.admit(job.id, identity(job), job.devices, logical)
        processes.forget_outcome(job.id)
        restored = await checkpoints.restore(job.id, job.devices, logical, user=identity(job))
    except NoValidCheckpoint as error:
        return RestoreFailed(str(error))
    except (CheckpointError, DeviceError, OSError) as error:
        return RestoreFailed(str(error), checkpoint_good=True)
    process = processes.adopt_restored(job.id, restored.pid)
    down = restored.downtime.summary() if restored.downtime else ""
    return Restored(process.pid, process.start_ticks, restored.seq, restored.skipped, restored.problem, down)


def still_runs(job: JobRecord, processes: Processes) -> bool:
    """Whether the job's supervisor, as the store names it, is still there."""
    if job.init_pid is None or job.init_start_ticks is None:
        return True  # not known: the job is taken to run
    return processes.alive(ProcessId(job.init_pid, job.init_start_ticks))


async def checkpoint(
    job: JobRecord,
    take: TakeCheckpoint,
    processes: Processes,
    checkpoints: Checkpoints,
    hooks: PauseHooks | None = None,
) -> tuple[Checkpointed | CheckpointFailed, CheckpointTaken | StateConflict]:
    """Checkpoint the job's processes; the stimulus, and what the request that asked receives."""
    try:
        if job.init_pid is None:
            raise CheckpointError(f"job {job.id} is still starting")
        logs = tuple(processes.paths(job.id).rewind_paths(job.spec.ranks))
        target = CheckpointTarget(job.id, job.init_pid, job.spec.uid, job.spec.gid, job.devices, logs)
        purpose = StopPurpose.of(take)
        taken = await checkpoints.take(
            target,
            stop=take.stop,
            reason=take.reason,
            hooks=hooks,
            purpose=purpose.as_dict() if purpose else None,
        )
    except CheckpointError as error:
        if isinstance(error, JobEnded) or not still_runs(job, processes):
            ended = f"job {job.id} ended while it was being checkpointed"
            return CheckpointFailed(ended, job_ended=True), StateConflict(ended)
        return CheckpointFailed(str(error)), StateConflict(f"checkpoint failed: {error}")
    return Checkpointed(taken.summary, taken.image_bytes, taken.pause_s, taken.complete_s), taken
