"""The gRPC servicer: singularity.v1 messages in, calls on a `JobService` out, for one caller.

This is the only place that knows gRPC status codes: the domain refuses requests with the plain
errors of singularityd.errors, and `STATUS_OF` says which status each becomes (the CLI then maps
statuses to exit codes).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from functools import wraps
from typing import Any, TypeVar

import grpc

from singularityd.api.protocol import DeviceFacts, JobService
from singularityd.api.v1 import singularity_pb2 as pb
from singularityd.api.v1 import singularity_pb2_grpc as pb_grpc
from singularityd.checkpoint.coordinator import StoredCheckpoint
from singularityd.errors import (
    InvalidRequest,
    NotFound,
    PermissionDenied,
    RequestError,
    StateConflict,
    StoreUnwritable,
    Unsatisfiable,
)
from singularityd.identity import Caller
from singularityd.jobs.submission import SubmitArgs
from singularityd.store import JobRecord

Response = TypeVar("Response")

STATUS_OF: dict[type[RequestError], grpc.StatusCode] = {
    NotFound: grpc.StatusCode.NOT_FOUND,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    Unsatisfiable: grpc.StatusCode.FAILED_PRECONDITION,
    StateConflict: grpc.StatusCode.FAILED_PRECONDITION,
    StoreUnwritable: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def status_of(error: RequestError) -> grpc.StatusCode:
    """The gRPC status for a refused request (UNKNOWN for a kind not listed)."""
    for kind in type(error).__mro__:
        if kind in STATUS_OF:
            return STATUS_OF[kind]
    return grpc.StatusCode.UNKNOWN


def checkpoint_message(checkpoint: StoredCheckpoint) -> pb.CheckpointInfo:
    """One of a job's checkpoints as an API message, with the pause taking it cost the job."""
    return pb.CheckpointInfo(
        seq=checkpoint.seq,
        created_at=checkpoint.created_at,
        bytes=checkpoint.image_bytes,
        complete=checkpoint.complete,
        pause_seconds=checkpoint.pause_s,
    )


def device_message(facts: DeviceFacts) -> pb.Device:
    """A device as an API message: its memory and utilisation, holders, proxy health and sessions."""
    device, health = facts.device, facts.health
    message = pb.Device(
        index=device.index,
        kind=device.kind,
        name=device.name,
        uuid=device.uuid,
        memory_total=device.memory_total,
        memory_used=device.memory_used,
        jobs=facts.jobs,
        proxy=health.proxy,
        sessions=[
            pb.DeviceSession(job=s.job, rank=s.rank, bytes=s.bytes, connected=s.connected)
            for s in health.sessions
        ],
    )
    if device.utilization_percent is not None:
        message.utilization_percent = device.utilization_percent
    return message


def job_message(job: JobRecord, jobs: JobService) -> pb.Job:
    """A stored job as an API message, with live usage for running jobs and its newest checkpoint."""
    live = jobs.live(job)
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
        checkpoint_interval=live.checkpoint_interval,
        checkpoints=live.checkpoints,
        checkpoint_bytes=live.checkpoint_bytes,
        starting=live.starting,
    )
    if live.last_checkpoint is not None:
        message.last_checkpoint.CopyFrom(checkpoint_message(live.last_checkpoint))
    if job.exit_code is not None:
        message.exit_code = job.exit_code
    if job.signal is not None:
        message.signal = job.signal
    if live.usage is not None:
        message.cpu_seconds = live.usage.cpu_seconds
        message.rss_bytes = live.usage.rss_bytes
    return message


def _translating_errors(
    method: Callable[..., Awaitable[Response]],
) -> Callable[..., Awaitable[Response]]:
    """Turn a refused request into its gRPC status, with the same one-line message."""

    @wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Response:
        try:
            return await method(self, request, context)
        except RequestError as error:
            await context.abort(status_of(error), error.message)
            raise  # unreachable: abort raises

    return wrapper


class SingularityService(pb_grpc.SingularityServicer):  # type: ignore[misc]
    """Serves one caller, whose identity the kernel gave when they connected."""

    def __init__(self, jobs: JobService, caller: Caller) -> None:
        self.jobs = jobs
        self.caller = caller

    @_translating_errors
    async def Submit(self, request: pb.SubmitRequest, context: Any) -> pb.SubmitResponse:
        job = self.jobs.submit(
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
        return pb.SubmitResponse(job=job_message(job, self.jobs))

    def _listed(self, request: pb.ListJobsRequest) -> list[pb.Job]:
        jobs = self.jobs.jobs(include_finished=request.all)
        return [job_message(j, self.jobs) for j in jobs if not request.user or j.spec.user == request.user]

    @_translating_errors
    async def ListJobs(self, request: pb.ListJobsRequest, context: Any) -> pb.ListJobsResponse:
        return pb.ListJobsResponse(jobs=self._listed(request))

    async def WatchJobs(self, request: pb.ListJobsRequest, context: Any) -> AsyncIterator[pb.JobUpdate]:
        with self.jobs.subscribe() as changes:
            yield pb.JobUpdate(jobs=self._listed(request), is_change=False)
            while True:
                changed = {await changes.get()}
                while not changes.empty():
                    changed.add(changes.get_nowait())
                messages = []
                for job_id in sorted(changed):
                    try:
                        job = self.jobs.job(job_id)
                    except NotFound:
                        continue
                    if not request.user or job.spec.user == request.user:
                        messages.append(job_message(job, self.jobs))
                if messages:
                    yield pb.JobUpdate(jobs=messages, is_change=True)

    @_translating_errors
    async def GetJob(self, request: pb.JobRef, context: Any) -> pb.JobDetail:
        job = self.jobs.job(request.id)
        detail = pb.JobDetail(
            job=job_message(job, self.jobs),
            events=[
                pb.Event(
                    at=e.at,
                    from_state=e.from_state.value if e.from_state else "",
                    to_state=e.to_state.value,
                    reason=e.reason,
                )
                for e in self.jobs.events(job.id)
            ],
        )
        detail.checkpoint_list.extend(checkpoint_message(c) for c in self.jobs.checkpoints(job.id))
        if self.caller.may_act_on(job.spec.uid):
            detail.env.update(job.spec.env)
            detail.log_path = str(self.jobs.log_path(job.id, 0))
        return detail

    async def StreamLogs(self, request: pb.LogsRequest, context: Any) -> AsyncIterator[pb.LogChunk]:
        try:
            chunks = self.jobs.read_log(
                self.caller, request.id, request.rank, request.follow, request.tail, request.offset
            )
        except RequestError as error:
            await context.abort(status_of(error), error.message)
            raise  # unreachable: abort raises
        async for offset, data in chunks:
            yield pb.LogChunk(data=data, offset=offset)

    @_translating_errors
    async def Cancel(self, request: pb.CancelRequest, context: Any) -> pb.CancelResponse:
        results = []
        for job_id in request.ids:
            try:
                job = self.jobs.cancel(self.caller, job_id)
            except RequestError as error:
                code = status_of(error).value[0]
                results.append(pb.CancelResult(id=job_id, ok=False, error=error.message, code=code))
            else:
                results.append(pb.CancelResult(id=job_id, ok=True, state=job.state.value))
        return pb.CancelResponse(results=results)

    @_translating_errors
    async def Wait(self, request: pb.JobRef, context: Any) -> pb.Job:
        job = await self.jobs.wait_for_end(request.id)
        return job_message(job, self.jobs)

    @_translating_errors
    async def ListDevices(self, request: pb.ListDevicesRequest, context: Any) -> pb.ListDevicesResponse:
        return pb.ListDevicesResponse(devices=[device_message(d) for d in await self.jobs.devices()])

    @_translating_errors
    async def Preempt(self, request: pb.JobRef, context: Any) -> pb.Job:
        return job_message(await self.jobs.preempt(self.caller, request.id, hold=False), self.jobs)

    @_translating_errors
    async def Suspend(self, request: pb.JobRef, context: Any) -> pb.Job:
        return job_message(await self.jobs.preempt(self.caller, request.id, hold=True), self.jobs)

    @_translating_errors
    async def Resume(self, request: pb.JobRef, context: Any) -> pb.Job:
        return job_message(self.jobs.resume(self.caller, request.id), self.jobs)

    @_translating_errors
    async def Checkpoint(self, request: pb.JobRef, context: Any) -> pb.CheckpointResponse:
        job, taken = await self.jobs.checkpoint(self.caller, request.id)
        return pb.CheckpointResponse(
            job=job_message(job, self.jobs),
            checkpoint=pb.CheckpointInfo(
                seq=taken.seq,
                created_at=taken.created_at,
                bytes=taken.image_bytes,
                complete=True,
                pause_seconds=taken.pause_s,
            ),
            pause_seconds=taken.pause_s,
        )

    @_translating_errors
    async def GetDaemonInfo(self, request: pb.DaemonInfoRequest, context: Any) -> pb.DaemonInfo:
        return pb.DaemonInfo(
            caller_uid=self.caller.uid,
            caller_user=self.caller.user,
            caller_is_admin=self.caller.is_admin,
            **asdict(self.jobs.info()),
        )


def add_service(server: grpc.aio.Server, jobs: JobService, caller: Caller) -> SingularityService:
    """Register the servicer for one caller on a gRPC server; returns it."""
    service = SingularityService(jobs, caller)
    pb_grpc.add_SingularityServicer_to_server(service, server)
    return service
