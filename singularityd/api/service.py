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
from singularityd.checkpoint.interface import StoredCheckpoint
from singularityd.errors import (
    InvalidRequest,
    NotFound,
    PermissionDenied,
    RequestError,
    StateConflict,
    StoreUnwritable,
    Unsatisfiable,
)
from singularityd.federation.facts import JoinInfo, MoveReport, listing_fields
from singularityd.federation.v1 import peer_pb2
from singularityd.identity import Caller
from singularityd.jobs.submission import SubmitArgs, default_gpus
from singularityd.scheduling.replicas import device_range
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
    message = pb.CheckpointInfo(
        seq=checkpoint.seq,
        created_at=checkpoint.created_at,
        bytes=checkpoint.image_bytes,
        complete=checkpoint.complete,
        pause_seconds=checkpoint.pause_s,
    )
    pause = checkpoint.pause
    if pause is not None:
        message.complete_seconds = checkpoint.complete_s
        message.stopped = pause.stopped
        message.precopied_bytes = pause.device.reused_bytes
        message.paused_bytes = pause.device.paused_copied_bytes + (
            pause.device.written_after_bytes if pause.stopped else 0
        )
    return message


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
    """A stored job as an API message, with live usage for running jobs and its newest checkpoint;
    its elastic range is the one the scheduler applies (a refused splice raises it to the ranks)."""
    live = jobs.live(job)
    min_gpus, max_gpus = device_range(
        job.spec.ranks, job.spec.min_gpus, job.spec.max_gpus, job.splice_refusal
    )
    message = pb.Job(
        **listing_fields(job),
        checkpoint_interval=live.checkpoint_interval,
        checkpoints=live.checkpoints,
        checkpoint_bytes=live.checkpoint_bytes,
        starting=live.starting,
        max_restarts=job.spec.max_restarts,
        restarts_used=job.restarts_used,
        min_gpus=min_gpus,
        max_gpus=max_gpus,
        splice_refusal=job.splice_refusal,
    )
    if live.last_checkpoint is not None:
        message.last_checkpoint.CopyFrom(checkpoint_message(live.last_checkpoint))
    if live.move is not None:
        move = live.move
        message.move.CopyFrom(
            pb.MoveInfo(peer=move.peer, phase=move.phase, moved=move.moved, total=move.total, sent=move.sent)
        )
    if job.exit_code is not None:
        message.exit_code = job.exit_code
    if job.signal is not None:
        message.signal = job.signal
    if live.usage is not None:
        message.cpu_seconds = live.usage.cpu_seconds
        message.rss_bytes = live.usage.rss_bytes
    return message


def peer_job_message(node: str, job: peer_pb2.PeerJob) -> pb.Job:
    """A job a peer described (`sing ps --cluster`), as an API message naming its node."""
    message = pb.Job(node=node)
    message.MergeFromString(job.SerializeToString())
    return message


def join_info_message(info: JoinInfo) -> pb.ClusterJoinInfo:
    """What a joining node needs, as an API message."""
    return pb.ClusterJoinInfo(
        node_name=info.node_name,
        token=info.token,
        ca_fingerprint=info.ca_fingerprint,
        join_address=info.join_address,
        token_expires_at=info.token_expires_at,
        node_number=info.node_number,
    )


def move_message(report: MoveReport) -> pb.MoveProgress:
    """One step of a move, as an API message."""
    return pb.MoveProgress(
        id=report.job_id,
        peer=report.peer,
        phase=report.phase,
        moved=report.moved,
        total=report.total,
        done=report.done,
        ok=report.ok,
        detail=report.detail,
    )


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
        ranks = request.ranks if request.HasField("ranks") else 1
        job = self.jobs.submit(
            self.caller,
            SubmitArgs(
                command=tuple(request.command),
                name=request.name,
                gpus=(
                    request.gpus
                    if request.HasField("gpus")
                    else default_gpus(ranks, request.min_gpus, request.max_gpus)
                ),
                priority=request.priority,
                ranks=ranks,
                cwd=request.cwd,
                env=dict(request.env),
                checkpoint_interval=(
                    request.checkpoint_interval if request.HasField("checkpoint_interval") else None
                ),
                max_restarts=request.max_restarts,
                min_gpus=request.min_gpus,
                max_gpus=request.max_gpus,
                tier=request.tier,
            ),
            request.anywhere if request.HasField("anywhere") else None,
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
                self.caller,
                request.id,
                request.rank,
                request.follow,
                request.tail if request.HasField("tail") else None,
                request.offset,
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
    async def Resize(self, request: pb.ResizeRequest, context: Any) -> pb.Job:
        return job_message(await self.jobs.resize(self.caller, request.id, request.gpus), self.jobs)

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
                complete_seconds=taken.complete_s,
                stopped=taken.stopped,
                precopied_bytes=taken.precopied_bytes,
                paused_bytes=taken.paused_bytes,
            ),
            pause_seconds=taken.pause_s,
        )

    @_translating_errors
    async def ClusterInit(self, request: pb.ClusterInitRequest, context: Any) -> pb.ClusterJoinInfo:
        info = await self.jobs.cluster_init(self.caller, request.node_name, request.cluster_name)
        return join_info_message(info)

    @_translating_errors
    async def ClusterToken(self, request: pb.ClusterTokenRequest, context: Any) -> pb.ClusterJoinInfo:
        return join_info_message(await self.jobs.cluster_token(self.caller))

    @_translating_errors
    async def ClusterJoin(self, request: pb.ClusterJoinRequest, context: Any) -> pb.ClusterJoinResponse:
        node, number, ca_node = await self.jobs.cluster_join(
            self.caller, request.address, request.token, request.ca_fingerprint, request.node_name
        )
        return pb.ClusterJoinResponse(node_name=node, node_number=number, ca_node=ca_node)

    @_translating_errors
    async def ListPeers(self, request: pb.ListPeersRequest, context: Any) -> pb.ListPeersResponse:
        view = self.jobs.peers()
        return pb.ListPeersResponse(
            node=view.node,
            node_number=view.number,
            draining=view.draining,
            peers=[
                pb.Peer(
                    node=row.node,
                    address=row.address,
                    state=str(row.state),
                    devices=row.devices,
                    free=row.free,
                    version=row.version,
                    last_contact=row.last_contact or 0.0,
                    draining=row.draining,
                    error=row.error,
                )
                for row in view.peers
            ],
        )

    async def _stream_moves(
        self, start: Callable[[], AsyncIterator[MoveReport]], context: Any, *, single: bool
    ) -> AsyncIterator[pb.MoveProgress]:
        """Stream moves' progress; a refusal ends it with its status, and so does the failure of a
        `single` move (`sing migrate`), after its last message."""
        try:
            async for report in start():
                message = move_message(report)
                if single and report.done and not report.ok:
                    why = f"job {report.job_id} did not move to {report.peer}: {report.detail}"
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
                yield message
        except RequestError as error:
            await context.abort(status_of(error), error.message)

    async def Migrate(self, request: pb.MigrateRequest, context: Any) -> AsyncIterator[pb.MoveProgress]:
        def start() -> AsyncIterator[MoveReport]:
            return self.jobs.migrate(self.caller, request.id, request.to)

        async for message in self._stream_moves(start, context, single=True):
            yield message

    async def Drain(self, request: pb.DrainRequest, context: Any) -> AsyncIterator[pb.MoveProgress]:
        async for message in self._stream_moves(lambda: self.jobs.drain(self.caller), context, single=False):
            yield message

    @_translating_errors
    async def Undrain(self, request: pb.DrainRequest, context: Any) -> pb.DrainResponse:
        self.jobs.undrain(self.caller)
        return pb.DrainResponse(draining=False)

    @_translating_errors
    async def ListClusterJobs(self, request: pb.ListJobsRequest, context: Any) -> pb.ListClusterJobsResponse:
        listing = await self.jobs.cluster_jobs(request.all)
        node = self.jobs.peers().node
        jobs = [job_message(job, self.jobs) for job in listing.local]
        for message in jobs:
            message.node = node
        jobs += [peer_job_message(peer, job) for peer, job in listing.remote]
        jobs = [j for j in jobs if not request.user or j.user == request.user]
        jobs.sort(key=lambda j: j.id)
        return pb.ListClusterJobsResponse(jobs=jobs, unreachable=listing.unreachable)

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
