"""The gRPC servicer: translates singularity.v1 messages to daemon calls for one known caller."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from singularity.proxy.control import ControlError, ProxyControl
from singularityd.api.v1 import singularity_pb2 as pb
from singularityd.api.v1 import singularity_pb2_grpc as pb_grpc
from singularityd.checkpoint.manifest import Manifest
from singularityd.identity import Caller
from singularityd.requests import RequestError, SubmitArgs
from singularityd.store import JobRecord

if TYPE_CHECKING:
    from singularityd.daemon import Daemon

Response = TypeVar("Response")


def job_message(job: JobRecord, daemon: Daemon) -> pb.Job:
    """A stored job as an API message, with live usage for running jobs."""
    message = pb.Job(
        id=job.id,
        name=job.spec.name,
        user=job.spec.user,
        uid=job.spec.uid,
        state=job.state.value,
        reason=job.reason,
        pending_reason=job.pending_reason if job.state.is_queued else "",
        priority=job.spec.priority,
        gpus=job.spec.gpus,
        ranks=job.spec.ranks,
        devices=list(job.devices),
        command=list(job.spec.command),
        submitted_at=job.submitted_at,
        started_at=job.started_at or 0.0,
        ended_at=job.ended_at or 0.0,
        cwd=job.spec.cwd,
        attempt=job.attempt,
        checkpoint_interval=daemon.checkpoint_interval(job),
        starting=job.state.holds_devices and job.init_pid is None,
    )
    message.checkpoints, message.checkpoint_bytes = daemon.checkpoint_usage(job.id)
    latest = daemon.latest_checkpoint(job.id)
    if latest is not None:
        message.last_checkpoint.CopyFrom(checkpoint_message(latest))
    if job.exit_code is not None:
        message.exit_code = job.exit_code
    if job.signal is not None:
        message.signal = job.signal
    usage = daemon.usage(job)
    if usage is not None:
        message.cpu_seconds = usage.cpu_seconds
        message.rss_bytes = usage.rss_bytes
    return message


def checkpoint_message(manifest: Manifest) -> pb.CheckpointInfo:
    """A complete checkpoint as an API message, with the pause CRIU measured for its final dump."""
    frozen_us = manifest.stats.get("dump", {}).get("frozen_us", 0)
    return pb.CheckpointInfo(
        seq=manifest.seq,
        created_at=manifest.created_at,
        bytes=manifest.total_bytes,
        complete=True,
        pause_seconds=frozen_us / 1e6,
    )


def proxy_status(control: Path) -> tuple[str, list[pb.DeviceSession], int]:
    """Ask a running proxy server how it is: its health, its sessions and the bytes allocated."""
    try:
        with ProxyControl(control, timeout=2.0) as proxy:
            status = proxy.status()
    except (OSError, ControlError) as error:
        return f"down: {error}", [], 0
    sessions = []
    for key, session in sorted(status.get("jobs", {}).items()):
        job, _, rank = str(key).partition("/")
        with contextlib.suppress(ValueError):
            sessions.append(
                pb.DeviceSession(
                    job=int(job),
                    rank=int(rank),
                    bytes=int(session.get("bytes", 0)),
                    connected=bool(session.get("connected")),
                )
            )
    return "up", sessions, int(status.get("allocated", 0))


def _translating_errors(
    method: Callable[..., Awaitable[Response]],
) -> Callable[..., Awaitable[Response]]:
    """Turn the daemon's RequestError into a gRPC status with the same message."""

    @wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Response:
        try:
            return await method(self, request, context)
        except RequestError as error:
            await context.abort(error.kind, error.message)
            raise  # unreachable: abort raises
        except sqlite3.Error as error:
            message = f"the daemon cannot write its state database: {error}"
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
            raise

    return wrapper


class SingularityService(pb_grpc.SingularityServicer):  # type: ignore[misc]
    """Serves one caller, whose identity the kernel gave when they connected."""

    def __init__(self, daemon: Daemon, caller: Caller) -> None:
        self.daemon = daemon
        self.caller = caller

    @_translating_errors
    async def Submit(self, request: pb.SubmitRequest, context: Any) -> pb.SubmitResponse:
        job = self.daemon.submit(
            self.caller,
            SubmitArgs(
                command=tuple(request.command),
                name=request.name,
                gpus=request.gpus if request.HasField("gpus") else 1,
                priority=request.priority,
                ranks=request.ranks if request.HasField("ranks") else 1,
                cwd=request.cwd,
                env=dict(request.env),
                checkpoint_interval=(
                    request.checkpoint_interval if request.HasField("checkpoint_interval") else None
                ),
            ),
        )
        return pb.SubmitResponse(job=job_message(job, self.daemon))

    def _listed(self, request: pb.ListJobsRequest) -> list[pb.Job]:
        jobs = self.daemon.store.list_jobs(include_finished=request.all)
        return [job_message(j, self.daemon) for j in jobs if not request.user or j.spec.user == request.user]

    @_translating_errors
    async def ListJobs(self, request: pb.ListJobsRequest, context: Any) -> pb.ListJobsResponse:
        return pb.ListJobsResponse(jobs=self._listed(request))

    async def WatchJobs(self, request: pb.ListJobsRequest, context: Any) -> AsyncIterator[pb.JobUpdate]:
        with self.daemon.subscribe() as changes:
            yield pb.JobUpdate(jobs=self._listed(request), is_change=False)
            while True:
                changed = {await changes.get()}
                while not changes.empty():
                    changed.add(changes.get_nowait())
                jobs = [self.daemon.store.get(job_id) for job_id in sorted(changed)]
                messages = [
                    job_message(j, self.daemon)
                    for j in jobs
                    if j is not None and (not request.user or j.spec.user == request.user)
                ]
                if messages:
                    yield pb.JobUpdate(jobs=messages, is_change=True)

    @_translating_errors
    async def GetJob(self, request: pb.JobRef, context: Any) -> pb.JobDetail:
        job = self.daemon.get_job(request.id)
        detail = pb.JobDetail(
            job=job_message(job, self.daemon),
            events=[
                pb.Event(
                    at=e.at,
                    from_state=e.from_state.value if e.from_state else "",
                    to_state=e.to_state.value,
                    reason=e.reason,
                )
                for e in self.daemon.store.events(job.id)
            ],
        )
        for seq, created, size, complete in self.daemon.checkpoint_list(job.id):
            manifest = self.daemon.checkpoint_manifest(job.id, seq) if complete else None
            detail.checkpoint_list.append(
                checkpoint_message(manifest)
                if manifest is not None
                else pb.CheckpointInfo(seq=seq, created_at=created, bytes=size, complete=complete)
            )
        if self.caller.may_act_on(job.spec.uid):
            detail.env.update(job.spec.env)
            detail.log_path = str(self.daemon.job_paths(job.id).rank_log(0))
        return detail

    async def StreamLogs(self, request: pb.LogsRequest, context: Any) -> AsyncIterator[pb.LogChunk]:
        try:
            job = self.daemon.owned_job(self.caller, request.id)
            if not 0 <= request.rank < job.spec.ranks:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"job {job.id} has ranks 0 to {job.spec.ranks - 1}, not {request.rank}",
                )
        except RequestError as error:
            await context.abort(error.kind, error.message)
        offset = request.offset
        if offset <= 0:
            offset = 0
            if request.tail > 0:
                offset = await asyncio.to_thread(
                    self.daemon.log_tail_offset, request.id, request.rank, request.tail
                )
        async for data in self.daemon.follow_log(request.id, request.rank, request.follow, 0, offset):
            yield pb.LogChunk(data=data, offset=offset)
            offset += len(data)

    @_translating_errors
    async def Cancel(self, request: pb.CancelRequest, context: Any) -> pb.CancelResponse:
        results = []
        for job_id in request.ids:
            try:
                job = self.daemon.cancel(self.caller, job_id)
            except RequestError as error:
                results.append(
                    pb.CancelResult(id=job_id, ok=False, error=error.message, code=error.kind.value[0])
                )
            else:
                results.append(pb.CancelResult(id=job_id, ok=True, state=job.state.value))
        return pb.CancelResponse(results=results)

    @_translating_errors
    async def Wait(self, request: pb.JobRef, context: Any) -> pb.Job:
        job = await self.daemon.wait_for_end(request.id)
        return job_message(job, self.daemon)

    @_translating_errors
    async def ListDevices(self, request: pb.ListDevicesRequest, context: Any) -> pb.ListDevicesResponse:
        busy = self.daemon.store.busy_devices()
        devices = []
        for device in self.daemon.current_devices():
            message = pb.Device(
                index=device.index,
                kind=device.kind,
                name=device.name,
                uuid=device.uuid,
                memory_total=device.memory_total,
                memory_used=device.memory_used,
                jobs=[busy[device.index]] if device.index in busy else [],
            )
            if device.utilization_percent is not None:
                message.utilization_percent = device.utilization_percent
            proxies = self.daemon.proxies
            if proxies is not None and proxies.running(device.index):
                health, sessions, allocated = await asyncio.to_thread(
                    proxy_status, proxies.control(device.index)
                )
                message.proxy = health
                message.sessions.extend(sessions)
                if device.kind == "virtual":
                    message.memory_used = allocated
            elif proxies is not None:
                message.proxy = "idle"
            devices.append(message)
        return pb.ListDevicesResponse(devices=devices)

    @_translating_errors
    async def Preempt(self, request: pb.JobRef, context: Any) -> pb.Job:
        return job_message(await self.daemon.preempt(self.caller, request.id, hold=False), self.daemon)

    @_translating_errors
    async def Suspend(self, request: pb.JobRef, context: Any) -> pb.Job:
        return job_message(await self.daemon.preempt(self.caller, request.id, hold=True), self.daemon)

    @_translating_errors
    async def Resume(self, request: pb.JobRef, context: Any) -> pb.Job:
        return job_message(self.daemon.resume(self.caller, request.id), self.daemon)

    @_translating_errors
    async def Checkpoint(self, request: pb.JobRef, context: Any) -> pb.CheckpointResponse:
        job, result = await self.daemon.checkpoint(self.caller, request.id)
        return pb.CheckpointResponse(
            job=job_message(job, self.daemon),
            checkpoint=pb.CheckpointInfo(
                seq=result.seq,
                created_at=result.manifest.created_at,
                bytes=result.image_bytes,
                complete=True,
                pause_seconds=result.pause_s,
            ),
            pause_seconds=result.pause_s,
        )

    @_translating_errors
    async def GetDaemonInfo(self, request: pb.DaemonInfoRequest, context: Any) -> pb.DaemonInfo:
        return pb.DaemonInfo(
            caller_uid=self.caller.uid,
            caller_user=self.caller.user,
            caller_is_admin=self.caller.is_admin,
            **self.daemon.info(),
        )


def add_service(server: grpc.aio.Server, daemon: Daemon, caller: Caller) -> None:
    """Register the servicer for one caller on a gRPC server."""
    pb_grpc.add_SingularityServicer_to_server(SingularityService(daemon, caller), server)
