"""singularityd: owns the devices, keeps the queue, runs and supervises jobs.

The daemon turns requests and process exits into stimuli for the pure job state machine and the
scheduling policy (singularityd.core), records every decision in the store first and then carries
it out. Jobs outlive the daemon: after a crash or a restart it re-adopts those still running.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import argparse
import asyncio
import contextlib
import fcntl
import logging
import math
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from singularity.proxy.control import ControlError
from singularityd import __version__, runtime
from singularityd.api.service import add_service
from singularityd.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointResult,
    CheckpointUnavailable,
    Criu,
    ImageStore,
    locate_criu,
)
from singularityd.checkpoint.criu import tree_pids
from singularityd.checkpoint.manifest import IMAGES_DIR, MANIFEST_NAME, Manifest
from singularityd.config import OPTIONS, Config, ConfigError, load_config
from singularityd.core.jobs import (
    CancelRequested,
    Checkpointed,
    CheckpointFailed,
    CheckpointRequested,
    Decision,
    Exited,
    InvalidTransition,
    JobFacts,
    JobState,
    LaunchFailed,
    MarkCancelRequested,
    Note,
    PreemptRequested,
    ProcessesLost,
    ReleaseDevices,
    Requeued,
    Reschedule,
    RestoreFailed,
    ResumeRequested,
    Started,
    Stimulus,
    TakeCheckpoint,
    TerminateProcesses,
    decide,
)
from singularityd.core.policy import QueuedJob, RunningJob, plan_starts
from singularityd.devices import Device, Inventory, discover, refresh
from singularityd.identity import Caller, IdentityRelay, resolve_caller
from singularityd.proxies import ProxyError, ProxyPool, job_connections
from singularityd.requests import RequestError, SubmitArgs, not_found
from singularityd.store import JobRecord, JobSpec, Store, StoreError
from singularityd.units import human_bytes

log = logging.getLogger("singularityd")

MAX_PRIORITY = 1_000_000
PREEMPTION_RETRY_SECONDS = 60.0


@dataclass(frozen=True)
class CriuStatus:
    """Whether checkpoints can work here, with the binary used or the reason they cannot."""

    path: str
    version: str
    unavailable_reason: str


def checkpoint_summary(result: CheckpointResult) -> str:
    """What an event says about a checkpoint: its number, size, the pause and pre-copy."""
    text = f"checkpoint {result.seq} ({human_bytes(result.image_bytes)}, paused {result.pause_s:.2f}s"
    if result.pre_dumps:
        text += f" after {len(result.pre_dumps)} pre-copy round(s)"
    if result.pruned:
        text += f"; removed older checkpoint(s) {','.join(str(s) for s in result.pruned)}"
    return text + ")"


class Daemon:
    """The running daemon: store, devices, job processes and the API servers."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.started_at = time.time()
        self.store: Store
        self.inventory: Inventory
        self.criu = CriuStatus("", "", "not probed yet")
        self.checkpointer: Checkpointer | None = None
        self._checkpoint_usage: dict[int, tuple[int, int]] = {}
        self._manifests: dict[tuple[int, int], Manifest] = {}
        self._preemption_failed_at: dict[int, float] = {}
        self.proxies: ProxyPool | None = None
        self._checkpointing: set[int] = set()
        self._exited_while_checkpointing: set[int] = set()
        self._periodic: dict[int, asyncio.TimerHandle] = {}
        self._watches: dict[int, runtime.ProcessWatch] = {}
        self._kill_timers: dict[int, asyncio.TimerHandle] = {}
        self._launching: set[int] = set()
        self._subscribers: set[asyncio.Queue[int]] = set()
        self._schedule_requested = False
        self._servers: dict[int, grpc.aio.Server] = {}
        self._server_lock = asyncio.Lock()
        self._relay: IdentityRelay | None = None
        self._stopping = asyncio.Event()
        self._lock_file: Any = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # Start and stop

    def _prepare_directories(self) -> None:
        config = self.config
        config.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(config.state_dir, 0o755 if not config.user_mode else 0o700)
        config.jobs_dir.mkdir(exist_ok=True)
        os.chmod(config.jobs_dir, 0o711 if not config.user_mode else 0o700)
        config.socket.parent.mkdir(parents=True, exist_ok=True)
        if config.user_mode:
            os.chmod(config.socket.parent, 0o700)
        config.internal_socket_dir.mkdir(exist_ok=True)
        os.chmod(config.internal_socket_dir, 0o700)
        self._lock_file = open(config.state_dir / "daemon.lock", "w")  # noqa: SIM115
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"another singularityd is already running with state directory {config.state_dir}"
            ) from None
        if _socket_answers(config.socket):
            raise ConfigError(f"another singularityd is already listening on {config.socket}")

    async def start(self) -> None:
        """Open the store, find devices, re-adopt jobs, then start serving."""
        self._prepare_directories()
        self.store = Store(self.config.database)
        self.inventory = discover(
            self.config.devices, self.config.virtual_devices, self.config.virtual_device_memory_gib
        )
        log.info(
            "%d %s device(s); NVML %s",
            len(self.inventory.devices),
            self.inventory.kind,
            self.inventory.nvml_status,
        )
        if self.config.device_proxy:
            self.proxies = ProxyPool(
                self.config.socket.parent,
                self.config.state_dir,
                self.inventory.devices,
                self.config.proxy_threads,
            )
            self.proxies.start()
        await self._probe_criu()
        await self._recover()
        self._relay = IdentityRelay(
            self.config.socket,
            self._server_for_uid,
            frozenset({os.geteuid()}) if self.config.user_mode else None,
            0o600 if self.config.user_mode else 0o666,
        )
        await self._relay.start()
        self.request_schedule()
        log.info("singularityd %s listening on %s", __version__, self.config.socket)

    async def _probe_criu(self) -> None:
        try:
            info = await asyncio.to_thread(locate_criu, self.config.criu)
        except CheckpointUnavailable as error:
            self.criu = CriuStatus("", "", str(error))
            log.warning("checkpoints unavailable: %s", error)
            return
        self.criu = CriuStatus(" ".join(info.argv), info.version_text, "")
        images = ImageStore(self.config.checkpoints)
        self.checkpointer = Checkpointer(
            Criu(info), images, keep=self.config.checkpoint_keep, pre_copy=self.config.checkpoint_pre_copy
        )
        log.info("CRIU %s (%s); checkpoints in %s", info.version_text, info.source, self.config.checkpoints)

    async def stop(self) -> None:
        """Stop serving and close the store; jobs keep running and are re-adopted on restart."""
        if self._relay is not None:
            await self._relay.stop()
        if self.proxies is not None:
            self.proxies.stop()
        grace = self.config.shutdown_grace_seconds
        await asyncio.gather(*(server.stop(grace) for server in self._servers.values()))
        for watch in self._watches.values():
            watch.close()
        for timer in [*self._kill_timers.values(), *self._periodic.values()]:
            timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        self.store.close()
        for path in self.config.internal_socket_dir.glob("*.sock"):
            path.unlink(missing_ok=True)

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _server_for_uid(self, uid: int, gid: int) -> Path:
        """The private gRPC server that serves requests from this uid, started on first use."""
        path = self.config.internal_socket_dir / f"uid-{uid}.sock"
        async with self._server_lock:
            if uid not in self._servers:
                caller = resolve_caller(uid, gid, self.config.admin_group)
                server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
                add_service(server, self, caller)
                path.unlink(missing_ok=True)
                server.add_insecure_port(f"unix:{path}")
                await server.start()
                self._servers[uid] = server
        return path

    # Recovery

    async def _recover(self) -> None:
        """Re-adopt jobs whose processes still run; settle those that ended while we were down."""
        for job in self.store.list_jobs(states=(JobState.RUNNING, JobState.MIGRATING)):
            paths = self.job_paths(job.id)
            pid, ticks = job.init_pid, job.init_start_ticks
            if pid is None:
                recorded = runtime.read_pid_file(paths)
                if recorded is not None:
                    pid, ticks = recorded
                    self.store.set_process(job.id, pid, ticks)
            alive = pid is not None and ticks is not None and runtime.process_start_ticks(pid) == ticks
            if alive:
                assert pid is not None
                log.info("re-adopted job %d (supervisor pid %d)", job.id, pid)
                self._watch(job.id, pid)
                self._arm_periodic_checkpoint(job.id)
                if self.proxies is not None:
                    # A daemon killed in mid-checkpoint may have left the job parked in its proxies.
                    with contextlib.suppress(ProxyError, ControlError, OSError):
                        await self.proxies.resume(job.id, job.devices)
                continue
            status = runtime.read_exit_status(paths)
            if status is not None:
                self.apply(job.id, _exited(status), status)
            elif pid is None:
                self.apply(job.id, Requeued("launch interrupted by a daemon restart; queued again"))
            else:
                self.apply(
                    job.id,
                    ProcessesLost(
                        "the job's processes ended while the daemon was down, without an exit status"
                    ),
                )

    # Decisions

    def job_paths(self, job_id: int) -> runtime.JobPaths:
        """The folder of one job."""
        return runtime.JobPaths(self.config.jobs_dir / str(job_id))

    def apply(self, job_id: int, stimulus: Stimulus, status: runtime.ExitStatus | None = None) -> Decision:
        """Feed one stimulus to the state machine, record the result, carry out its actions."""
        job = self.store.get(job_id)
        if job is None:
            raise not_found(job_id)
        facts = JobFacts(
            job.id,
            job.state,
            job.cancel_requested,
            has_checkpoint=self.has_checkpoint(job.id),
            checkpointing=job.id in self._checkpointing,
            checkpoints_available=self.checkpointer is not None,
        )
        decision = decide(facts, stimulus, time.time())
        if decision.transition is not None:
            exit_code = signal_number = None
            if isinstance(stimulus, Exited):
                exit_code, signal_number = stimulus.exit_code, stimulus.signal
            self.store.record_transition(
                decision.transition,
                devices=stimulus.devices if isinstance(stimulus, Started) else None,
                exit_code=exit_code,
                signal=signal_number,
                cpu_seconds=status.cpu_seconds if status else None,
                max_rss_bytes=status.max_rss_bytes if status else None,
            )
            log.info(
                "job %d: %s -> %s (%s)",
                job_id,
                decision.transition.from_state,
                decision.transition.to_state,
                decision.transition.reason,
            )
        for action in decision.actions:
            match action:
                case MarkCancelRequested():
                    self.store.set_cancel_requested(job_id)
                case TerminateProcesses():
                    self._terminate(job_id)
                case ReleaseDevices():
                    self._forget_processes(job_id)
                case Reschedule():
                    self.request_schedule()
                case Note(reason=reason):
                    self.store.add_note(job_id, job.state, reason, time.time())
                    log.info("job %d: %s", job_id, reason)
                case TakeCheckpoint():
                    pass  # the caller runs the checkpoint and reports how it went
        self._notify(job_id)
        return decision

    def _notify(self, job_id: int) -> None:
        for queue in self._subscribers:
            queue.put_nowait(job_id)

    @contextlib.contextmanager
    def subscribe(self) -> Any:
        """A queue that receives the id of every job that changes while the context is open."""
        queue: asyncio.Queue[int] = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            yield queue
        finally:
            self._subscribers.discard(queue)

    def request_schedule(self) -> None:
        """Run the scheduling policy soon (many requests in one tick make one round)."""
        if not self._schedule_requested:
            self._schedule_requested = True
            asyncio.get_running_loop().call_soon(self._schedule)

    def _schedule(self) -> None:
        self._schedule_requested = False
        queued = self.store.list_jobs(states=(JobState.PENDING, JobState.PREEMPTED))
        if not queued:
            return
        busy = self.store.busy_devices()
        free = [d.index for d in self.inventory.devices if d.index not in busy]
        running = [
            RunningJob(
                j.id,
                j.spec.priority,
                j.started_at or 0.0,
                j.devices,
                stopping=j.id in self._checkpointing or j.cancel_requested,
                preemptible=self._preemptible(j),
            )
            for j in self.store.list_jobs(states=(JobState.RUNNING,))
        ]
        plan = plan_starts(
            [QueuedJob(j.id, j.spec.priority, j.id, j.spec.gpus) for j in queued],
            free,
            len(self.inventory.devices),
            running,
            can_preempt=self.checkpointer is not None,
        )
        for job_id, devices in plan.starts:
            self.apply(job_id, Started(devices))
            self._launching.add(job_id)
            self._spawn(self._launch(job_id))
        for job_id in plan.preemptions:
            self._spawn(self._scheduler_preempt(job_id))
        self.store.set_pending_reasons(plan.pending_reasons)
        for job_id in plan.pending_reasons:
            self._notify(job_id)

    # Processes

    async def _launch(self, job_id: int) -> None:
        job = self.store.get(job_id)
        assert job is not None
        paths = self.job_paths(job_id)
        if self.proxies is not None:
            self.proxies.admit(job_id, job.spec.uid, job.devices)
        if self.has_checkpoint(job_id):
            await self._restore(job_id, paths)
            return
        try:
            spec = await asyncio.to_thread(self._launch_spec, job, paths)
            pid, ticks = await runtime.launch(spec, paths)
        except (runtime.LaunchError, OSError) as error:
            self._launching.discard(job_id)
            self.apply(job_id, LaunchFailed(str(error)))
            return
        self._running(job_id, pid, ticks)

    def _running(self, job_id: int, pid: int, ticks: int) -> None:
        """The job's supervisor (launched or restored) runs: record it, watch it, arm checkpoints."""
        self._launching.discard(job_id)
        self.store.set_process(job_id, pid, ticks)
        log.info("job %d: supervisor pid %d", job_id, pid)
        self._watch(job_id, pid)
        self._arm_periodic_checkpoint(job_id)
        self._notify(job_id)
        current = self.store.get(job_id)
        if current is not None and current.cancel_requested:
            self._terminate(job_id)

    async def _restore(self, job_id: int, paths: runtime.JobPaths) -> None:
        assert self.checkpointer is not None
        paths.status.unlink(missing_ok=True)
        paths.pid.unlink(missing_ok=True)
        job = self.get_job(job_id)
        images = self.checkpointer.store
        opened: list[socket.socket] = []
        proxies = self.proxies

        def reconnect(manifest: Manifest) -> dict[str, int]:
            connections = manifest.extra.get("proxy_connections") or []
            if not connections:
                return {}
            if proxies is None:
                raise ProxyError("the job used device proxies, which are turned off in this daemon")
            folder = images.checkpoint_dir(str(job_id), manifest.seq) / IMAGES_DIR
            inherit, sockets = proxies.reconnect(job_id, job.devices, folder, connections)
            opened.extend(sockets)
            return inherit

        try:
            if proxies is not None and self._used_device_proxies(job_id):
                for device in job.devices:
                    await proxies.ensure_running(device)
            result = await self.checkpointer.restore_latest(str(job_id), inherit_fds=reconnect)
        except (CheckpointError, ProxyError, ControlError, OSError) as error:
            self._launching.discard(job_id)
            if proxies is not None:
                with contextlib.suppress(ProxyError, ControlError, OSError):
                    await proxies.release(job_id, job.devices)
            self.apply(job_id, RestoreFailed(str(error)))
            return
        finally:
            for connection in opened:
                connection.close()
        resume_error = ""
        if opened and proxies is not None:
            try:
                await proxies.resume(job_id, job.devices)
            except (ProxyError, ControlError, OSError) as error:
                resume_error = f"the device proxies did not resume the job: {error}"
        job = self.get_job(job_id)
        for skipped in result.skipped:
            self.store.add_note(
                job_id, job.state, f"checkpoint {skipped.seq} not used: {skipped.reason}", time.time()
            )
        self.store.add_note(job_id, job.state, f"restored from checkpoint {result.seq}", time.time())
        ticks = runtime.process_start_ticks(result.pid) or 0
        runtime.write_pid_file(paths, result.pid, ticks)
        self._running(job_id, result.pid, ticks)
        if resume_error:
            self.store.add_note(job_id, job.state, resume_error, time.time())
            self._terminate(job_id)

    def _launch_spec(self, job: JobRecord, paths: runtime.JobPaths) -> dict[str, Any]:
        spec = job.spec
        runtime.prepare_job_dir(paths)
        return {
            "job_id": job.id,
            "uid": spec.uid,
            "gid": spec.gid,
            "user": spec.user,
            "groups": runtime.user_groups(spec.user, spec.gid),
            "command": list(spec.command),
            "cwd": spec.cwd,
            "rank_envs": runtime.rank_environments(
                spec.env,
                job_id=job.id,
                user=spec.user,
                ranks=spec.ranks,
                devices=job.devices,
                device_env=self.device_environment(job),
                master_port=runtime.free_tcp_port(),
            ),
            "rank_logs": [str(paths.rank_log(r)) for r in range(spec.ranks)],
            "supervisor_log": str(paths.supervisor_log),
            "status_path": str(paths.status),
            "pid_path": str(paths.pid),
            "pid_namespace": not self.config.user_mode,
            "kill_grace_seconds": self.config.kill_grace_seconds,
        }

    def device_environment(self, job: JobRecord) -> dict[str, str]:
        """How the job's processes reach their devices: through the proxies, or directly."""
        if self.proxies is not None:
            return self.proxies.environment(job.devices, job.spec.env.get("PYTHONPATH"))
        if self.inventory.kind == "nvml":
            return {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in job.devices)}
        return {}

    def _watch(self, job_id: int, pid: int) -> None:
        self._watches[job_id] = runtime.ProcessWatch(pid, lambda: self._on_exit(job_id))

    def _on_exit(self, job_id: int) -> None:
        watch = self._watches.pop(job_id, None)
        if watch is not None:
            watch.close()
        if job_id in self._checkpointing:
            self._exited_while_checkpointing.add(job_id)
            return
        timer = self._kill_timers.pop(job_id, None)
        if timer is not None:
            timer.cancel()
        job = self.store.get(job_id)
        if job is None or not job.state.holds_devices:
            return
        status = runtime.read_exit_status(self.job_paths(job_id))
        if status is None:
            self.apply(
                job_id, ProcessesLost("the job's supervisor was killed before it recorded an exit status")
            )
        else:
            self.apply(job_id, _exited(status), status)

    def _terminate(self, job_id: int) -> None:
        watch = self._watches.get(job_id)
        if watch is None:
            return
        watch.signal(signal.SIGTERM)
        if job_id not in self._kill_timers:
            deadline = self.config.kill_grace_seconds + 2.0
            self._kill_timers[job_id] = asyncio.get_running_loop().call_later(
                deadline, lambda: watch.signal(signal.SIGKILL)
            )

    def _forget_processes(self, job_id: int) -> None:
        if self.proxies is not None:
            self.proxies.forget(job_id)
        watch = self._watches.pop(job_id, None)
        if watch is not None:
            watch.close()
        timer = self._periodic.pop(job_id, None)
        if timer is not None:
            timer.cancel()

    # Checkpoints

    def has_checkpoint(self, job_id: int) -> bool:
        """Whether the job has at least one complete checkpoint (verified only when restoring)."""
        if self.checkpointer is None:
            return False
        images = self.checkpointer.store
        return any(
            (images.checkpoint_dir(str(job_id), seq) / MANIFEST_NAME).exists()
            for seq in images.seqs(str(job_id))
        )

    def _used_device_proxies(self, job_id: int) -> bool:
        """Whether any complete checkpoint of the job holds device state saved by the proxies."""
        assert self.checkpointer is not None
        images = self.checkpointer.store
        for seq in images.seqs(str(job_id)):
            with contextlib.suppress(CheckpointError, OSError, ValueError):
                if images.read_manifest(str(job_id), seq).extra.get("proxy_connections"):
                    return True
        return False

    def checkpoint_interval(self, job: JobRecord) -> float:
        """The job's own periodic checkpoint interval, else the daemon's default (0: none)."""
        if job.spec.checkpoint_interval is not None:
            return job.spec.checkpoint_interval
        return self.config.checkpoint_interval_seconds

    def _arm_periodic_checkpoint(self, job_id: int) -> None:
        job = self.store.get(job_id)
        if job is None or self.checkpointer is None:
            return
        interval = self.checkpoint_interval(job)
        if interval <= 0:
            return
        self._periodic[job_id] = asyncio.get_running_loop().call_later(
            interval, lambda: self._spawn(self._periodic_checkpoint(job_id))
        )

    async def _periodic_checkpoint(self, job_id: int) -> None:
        self._periodic.pop(job_id, None)
        job = self.store.get(job_id)
        if job is None or job.state is not JobState.RUNNING or job_id not in self._watches:
            return
        if job_id not in self._checkpointing and not job.cancel_requested:
            with contextlib.suppress(RequestError):
                await self._checkpoint(job_id, stop=False, hold=False, reason="periodic checkpoint")
        if job_id in self._watches:
            self._arm_periodic_checkpoint(job_id)

    async def _checkpoint(self, job_id: int, *, stop: bool, hold: bool, reason: str) -> CheckpointResult:
        """Checkpoint a running job (and stop it when asked); record the outcome as events.

        The work runs as a task of its own that a caller giving up (a cancelled RPC) cannot
        interrupt, so its bookkeeping always completes.
        """
        task = asyncio.ensure_future(self._checkpoint_to_end(job_id, stop=stop, hold=hold, reason=reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def _checkpoint_to_end(
        self, job_id: int, *, stop: bool, hold: bool, reason: str
    ) -> CheckpointResult:
        assert self.checkpointer is not None
        job = self.get_job(job_id)
        if job.init_pid is None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, f"job {job_id} is still starting")
        paths = self.job_paths(job_id)
        logs = [str(paths.rank_log(r)) for r in range(job.spec.ranks)] + [str(paths.supervisor_log)]
        connections = await asyncio.to_thread(job_connections, tree_pids(job.init_pid))
        quiesced = False

        async def save_device_state(images: Path) -> None:
            nonlocal quiesced
            if self.proxies is not None and connections:
                quiesced = True
                await self.proxies.quiesce_and_save(job_id, job.devices, images)

        self._checkpointing.add(job_id)
        self._checkpoint_usage.pop(job_id, None)
        try:
            result = await self.checkpointer.checkpoint(
                str(job_id),
                job.init_pid,
                owner_uid=job.spec.uid,
                owner_gid=job.spec.gid,
                leave_running=not stop,
                rewind_paths=logs,
                external_unix_inodes=[c.inode for c in connections],
                before_final_dump=save_device_state,
                extra={
                    "reason": reason,
                    "devices": list(job.devices),
                    "proxy_connections": [c.as_dict() for c in connections],
                },
            )
        except (CheckpointError, ProxyError, ControlError, OSError) as error:
            self._checkpoint_usage.pop(job_id, None)
            if quiesced and self.proxies is not None:
                with contextlib.suppress(ProxyError, ControlError, OSError):
                    await self.proxies.resume(job_id, job.devices)
            self._checkpointing.discard(job_id)
            self.apply(job_id, CheckpointFailed(str(error)))
            if job_id in self._exited_while_checkpointing:
                self._exited_while_checkpointing.discard(job_id)
                self._on_exit(job_id)
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, f"checkpoint failed: {error}") from None
        self._checkpoint_usage.pop(job_id, None)
        if quiesced and self.proxies is not None:
            finish = self.proxies.release if stop else self.proxies.resume
            try:
                await finish(job_id, job.devices)
            except (ProxyError, ControlError, OSError) as error:
                log.error("job %d: proxy %s after the checkpoint failed: %s", job_id, finish.__name__, error)
        self._checkpointing.discard(job_id)
        exited = job_id in self._exited_while_checkpointing
        self._exited_while_checkpointing.discard(job_id)
        summary = f"{reason}: {checkpoint_summary(result)}"
        self.apply(job_id, Checkpointed(summary, stopped=stop, hold=hold))
        if exited and not stop:
            self._on_exit(job_id)
        return result

    async def _scheduler_preempt(self, job_id: int) -> None:
        try:
            self.apply(job_id, PreemptRequested("the scheduler (a higher-priority job needs its devices)"))
            await self._checkpoint(
                job_id, stop=True, hold=False, reason="preempted for a higher-priority job"
            )
        except (RequestError, InvalidTransition):
            self._preemption_failed_at[job_id] = time.monotonic()
            asyncio.get_running_loop().call_later(PREEMPTION_RETRY_SECONDS, self.request_schedule)
            return
        self.request_schedule()

    def _preemptible(self, job: JobRecord) -> bool:
        """A running job may be preempted once started, unless preempting it failed just now."""
        failed = self._preemption_failed_at.get(job.id)
        recent = failed is not None and time.monotonic() - failed < PREEMPTION_RETRY_SECONDS
        return job.init_pid is not None and not recent

    # Requests (called by the API servicer with the kernel-proven caller)

    def submit(self, caller: Caller, args: SubmitArgs) -> JobRecord:
        """Validate and queue a job that will run as the caller."""
        if not args.command or not args.command[0]:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, "empty command: give the program to run after --"
            )
        if args.gpus < 1:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, f"--gpus must be at least 1, not {args.gpus}"
            )
        if args.ranks < 1:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, f"--ranks must be at least 1, not {args.ranks}"
            )
        if abs(args.priority) > MAX_PRIORITY:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"--priority must be between -{MAX_PRIORITY} and {MAX_PRIORITY}",
            )
        total = len(self.inventory.devices)
        if args.gpus > total:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"requested {args.gpus} devices but this machine has {total}",
            )
        if not os.path.isabs(args.cwd):
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, f"working directory must be absolute: {args.cwd!r}"
            )
        if not os.path.isdir(args.cwd):
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, f"working directory {args.cwd} does not exist"
            )
        if args.checkpoint_interval is not None and not (
            math.isfinite(args.checkpoint_interval) and args.checkpoint_interval >= 0
        ):
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"--checkpoint-every must be 0 or more seconds, not {args.checkpoint_interval:g}",
            )
        bad = [key for key in args.env if not key or "=" in key or "\0" in key]
        if bad:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, f"invalid environment variable name {bad[0]!r}"
            )
        name = args.name or os.path.basename(args.command[0])
        spec = JobSpec(
            name=name,
            uid=caller.uid,
            gid=caller.gid,
            user=caller.user,
            priority=args.priority,
            gpus=args.gpus,
            ranks=args.ranks,
            command=args.command,
            env=args.env,
            cwd=args.cwd,
            checkpoint_interval=args.checkpoint_interval,
        )
        job = self.store.create_job(spec, time.time(), f"submitted by {caller.user}")
        log.info("job %d submitted by %s: %s", job.id, caller.user, " ".join(args.command))
        self._notify(job.id)
        self.request_schedule()
        return job

    def get_job(self, job_id: int) -> JobRecord:
        """The stored job, or NOT_FOUND."""
        job = self.store.get(job_id)
        if job is None:
            raise not_found(job_id)
        return job

    def owned_job(self, caller: Caller, job_id: int) -> JobRecord:
        """The job, if the caller may act on it; else NOT_FOUND or PERMISSION_DENIED."""
        job = self.get_job(job_id)
        if not caller.may_act_on(job.spec.uid):
            raise RequestError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"job {job_id} belongs to {job.spec.user}; {caller.user} may not act on it",
            )
        return job

    def apply_request(self, job_id: int, stimulus: Stimulus) -> Decision:
        """Apply a user's request; a state that does not allow it is the user's error, not ours."""
        try:
            return self.apply(job_id, stimulus)
        except InvalidTransition as error:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, str(error)) from None

    def cancel(self, caller: Caller, job_id: int) -> JobRecord:
        """Cancel a job: a queued one at once, a running one by signalling its processes."""
        self.owned_job(caller, job_id)
        self.apply_request(job_id, CancelRequested(caller.user))
        return self.get_job(job_id)

    async def _started(self, job_id: int, timeout: float = 120.0) -> None:
        """Wait while the job's processes are being launched or restored."""
        deadline = time.monotonic() + timeout
        while job_id in self._launching and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def preempt(self, caller: Caller, job_id: int, hold: bool) -> JobRecord:
        """Checkpoint and stop a running job (hold: until resumed by hand); returns once stopped."""
        self.owned_job(caller, job_id)
        await self._started(job_id)
        decision = self.apply_request(job_id, PreemptRequested(caller.user, hold=hold))
        if any(isinstance(a, TakeCheckpoint) for a in decision.actions):
            verb = "suspended" if hold else "preempted"
            await self._checkpoint(job_id, stop=True, hold=hold, reason=f"{verb} by {caller.user}")
        return self.get_job(job_id)

    def resume(self, caller: Caller, job_id: int) -> JobRecord:
        """Put a suspended job back in the queue."""
        self.owned_job(caller, job_id)
        self.apply_request(job_id, ResumeRequested(caller.user))
        return self.get_job(job_id)

    async def checkpoint(self, caller: Caller, job_id: int) -> tuple[JobRecord, CheckpointResult]:
        """Checkpoint a running job in place; returns once the checkpoint is complete."""
        self.owned_job(caller, job_id)
        await self._started(job_id)
        self.apply_request(job_id, CheckpointRequested(caller.user))
        result = await self._checkpoint(job_id, stop=False, hold=False, reason=f"checkpoint by {caller.user}")
        return self.get_job(job_id), result

    def checkpoint_usage(self, job_id: int) -> tuple[int, int]:
        """How many checkpoints the job has and the bytes they take on disk.

        Only the daemon writes checkpoints, so the figure is computed once and kept until the
        job's next checkpoint; listing many jobs does not walk their image folders.
        """
        if self.checkpointer is None:
            return 0, 0
        if job_id not in self._checkpoint_usage:
            usage = self.checkpointer.store.usage(str(job_id))
            self._checkpoint_usage[job_id] = (usage.checkpoints, usage.bytes_on_disk)
        return self._checkpoint_usage[job_id]

    def checkpoint_list(self, job_id: int) -> list[tuple[int, float, int, bool]]:
        """(seq, created_at, bytes, complete) of each of the job's checkpoint folders."""
        if self.checkpointer is None:
            return []
        images = self.checkpointer.store
        found = []
        for seq in images.seqs(str(job_id)):
            try:
                manifest = images.read_manifest(str(job_id), seq)
            except (CheckpointError, OSError, ValueError):
                found.append((seq, 0.0, 0, False))
                continue
            found.append((seq, manifest.created_at, manifest.total_bytes, True))
        return found

    def checkpoint_manifest(self, job_id: int, seq: int) -> Manifest | None:
        """The manifest of one of the job's complete checkpoints (read once: it never changes), or None."""
        if self.checkpointer is None:
            return None
        if (job_id, seq) not in self._manifests:
            try:
                self._manifests[job_id, seq] = self.checkpointer.store.read_manifest(str(job_id), seq)
            except (CheckpointError, OSError, ValueError):
                return None
        return self._manifests[job_id, seq]

    def latest_checkpoint(self, job_id: int) -> Manifest | None:
        """The manifest of the job's newest complete checkpoint, or None when it has none."""
        if self.checkpointer is None or not self.checkpoint_usage(job_id)[0]:
            return None
        for seq in reversed(self.checkpointer.store.seqs(str(job_id))):
            manifest = self.checkpoint_manifest(job_id, seq)
            if manifest is not None:
                return manifest
        return None

    async def wait_for_end(self, job_id: int) -> JobRecord:
        """Return the job once it has reached a terminal state."""
        with self.subscribe() as changes:
            while True:
                job = self.get_job(job_id)
                if job.state.is_terminal:
                    return job
                while await changes.get() != job_id:
                    pass

    def current_devices(self) -> tuple[Device, ...]:
        """The devices with live memory use and utilisation where the hardware reports them."""
        self.inventory = refresh(self.inventory)
        return self.inventory.devices

    def usage(self, job: JobRecord) -> runtime.Usage | None:
        """Live CPU time and memory for a running job; the recorded totals for an ended one."""
        if job.state.holds_devices and job.init_pid is not None:
            return runtime.usage(job.init_pid)
        if job.cpu_seconds is not None:
            return runtime.Usage(job.cpu_seconds, job.max_rss_bytes or 0)
        return None

    async def follow_log(
        self, job_id: int, rank: int, follow: bool, tail: int, offset: int | None = None
    ) -> AsyncIterator[bytes]:
        """The rank's log from byte `offset` (else its last `tail` lines, else the start), then new
        output if following."""
        path = self.job_paths(job_id).rank_log(rank)
        if offset is None:
            offset = await asyncio.to_thread(self.log_tail_offset, job_id, rank, tail) if tail > 0 else 0
        while True:
            job = self.get_job(job_id)
            ended = job.state.is_terminal or not follow
            with contextlib.suppress(FileNotFoundError), path.open("rb") as handle:
                handle.seek(offset)
                while chunk := handle.read(64 * 1024):
                    offset += len(chunk)
                    yield chunk
            if ended:
                return
            await asyncio.sleep(0.2)

    def log_tail_offset(self, job_id: int, rank: int, lines: int) -> int:
        """The byte offset where the last `lines` lines of the rank's log begin (0 without a log)."""
        path = self.job_paths(job_id).rank_log(rank)
        return _offset_of_last_lines(path, lines) if path.exists() else 0

    def info(self) -> dict[str, Any]:
        """Facts for `sing doctor`."""
        return {
            "version": __version__,
            "mode": "user" if self.config.user_mode else "system",
            "socket": str(self.config.socket),
            "state_dir": str(self.config.state_dir),
            "device_kind": self.inventory.kind,
            "device_count": len(self.inventory.devices),
            "nvml_status": self.inventory.nvml_status,
            "criu_unavailable_reason": self.criu.unavailable_reason,
            "criu_path": self.criu.path,
            "criu_version": self.criu.version,
            "started_at": self.started_at,
            "pid_namespaces": not self.config.user_mode,
        }


def _exited(status: runtime.ExitStatus) -> Exited:
    return Exited(status.exit_code, status.signal, status.error)


def _offset_of_last_lines(path: Path, lines: int) -> int:
    """Byte offset where the last `lines` lines of a file begin."""
    with path.open("rb") as handle:
        handle.seek(0, os.SEEK_END)
        end = position = handle.tell()
        found = 0
        block = 64 * 1024
        while position > 0:
            step = min(block, position)
            position -= step
            handle.seek(position)
            data = handle.read(step)
            if position + step == end and data.endswith(b"\n"):
                data = data[:-1]
            for index in range(len(data) - 1, -1, -1):
                if data[index] == 0x0A:
                    found += 1
                    if found == lines:
                        return position + index + 1
        return 0


def _socket_answers(path: Path) -> bool:
    """Whether something accepts connections on this Unix socket."""
    if not path.exists():
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def notify_systemd(message: str) -> None:
    """Send a state line to systemd when it started us with Type=notify (no-op otherwise)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(address)
            sock.sendall(message.encode())
        except OSError as error:
            log.warning("cannot notify systemd at %s: %s", address, error)


async def serve(config: Config) -> None:
    """Run the daemon until SIGTERM or SIGINT."""
    daemon = Daemon(config)
    await daemon.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    notify_systemd(f"READY=1\nSTATUS=serving on {config.socket}\nMAINPID={os.getpid()}")
    await stop.wait()
    log.info("stopping (running jobs keep running and are re-adopted on restart)")
    notify_systemd("STOPPING=1")
    await daemon.stop()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The daemon's command line; every flag overrides the config file and environment."""
    parser = argparse.ArgumentParser(
        prog="singularityd",
        description="The singularityd daemon. Options come from defaults, the config file, "
        "SING_* environment variables and these flags, later ones winning.",
    )
    parser.add_argument("--config", type=Path, help="TOML config file (env SING_CONFIG)")
    parser.add_argument("--socket", help="API socket path (env SING_SOCKET)")
    parser.add_argument("--state-dir", help="state directory (env SING_STATE_DIR)")
    parser.add_argument("--devices", choices=["auto", "nvml", "virtual"], help="device source")
    parser.add_argument("--virtual-devices", type=int, help="number of virtual devices")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--show-config", action="store_true", help="print the effective configuration and exit"
    )
    parser.add_argument("--version", action="version", version=f"singularityd {__version__}")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `singularityd`."""
    args = parse_args(argv)
    try:
        config = load_config(
            args.config,
            overrides={
                "socket": args.socket,
                "state_dir": args.state_dir,
                "devices": args.devices,
                "virtual_devices": args.virtual_devices,
                "log_level": args.log_level,
            },
        )
    except ConfigError as error:
        print(f"singularityd: {error}", file=sys.stderr)
        sys.exit(2)
    if args.show_config:
        for name, doc in OPTIONS.items():
            print(f"# {doc}\n{name} = {getattr(config, name)!r}\n")
        return
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        asyncio.run(serve(config))
    except (ConfigError, StoreError, RuntimeError) as error:
        print(f"singularityd: {error}", file=sys.stderr)
        sys.exit(2)
    except PermissionError as error:
        print(f"singularityd: permission denied: {error.filename or error}", file=sys.stderr)
        sys.exit(2)


__all__ = ["Daemon", "RequestError", "SubmitArgs", "main"]
