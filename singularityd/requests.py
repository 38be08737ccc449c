"""What people ask of the daemon: checked against the caller, turned into stimuli, answered.

`Requests` is the daemon as the API layer sees it: it implements singularityd.api.protocol's
`JobService`, the one interface the servicer depends on. Every refusal is a plain error from
singularityd.errors; the API layer alone turns those into wire status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

from singularityd import __version__
from singularityd.api.protocol import DaemonFacts, DeviceFacts, LiveFacts
from singularityd.checkpoint.interface import CheckpointTaken, StoredCheckpoint
from singularityd.core.actions import TakeCheckpoint
from singularityd.core.decisions import CheckpointUnderway, Decision, StillLaunching
from singularityd.core.states import InvalidTransition, JobState
from singularityd.core.stimuli import (
    CancelRequested,
    CheckpointRequested,
    PreemptRequested,
    ResizeRequested,
    ResumeRequested,
    Stimulus,
)
from singularityd.daemon import Daemon
from singularityd.errors import InvalidRequest, PermissionDenied, StateConflict
from singularityd.federation.facts import ClusterJobs, JoinInfo, MoveReport, PeersView
from singularityd.federation.service import Federation
from singularityd.identity import Caller
from singularityd.jobs.logs import read_log
from singularityd.jobs.processes import Usage
from singularityd.jobs.submission import SubmitArgs, check_resize, grow_refusal, validated_spec
from singularityd.observe.feed import JobSubmitted
from singularityd.store import EventRecord, JobRecord
from singularityd.tiers import PREMIUM

log = logging.getLogger("singularityd")

LAUNCH_WAIT_SECONDS = 120.0
CHECKPOINTS_WAITED_FOR = 3  # a request waits out at most this many checkpoints before it is refused


class Requests:
    """The requests the API serves, carried out by the daemon for a kernel-proven caller."""

    def __init__(
        self,
        daemon: Daemon,
        launch_wait_seconds: float = LAUNCH_WAIT_SECONDS,
        federation: Federation | None = None,
    ) -> None:
        self.daemon = daemon
        self.launch_wait_seconds = launch_wait_seconds
        self.federation = federation or Federation(daemon, daemon.config)

    # Reading

    def jobs(self, include_finished: bool) -> list[JobRecord]:
        """The live jobs, or all of them."""
        return self.daemon.store.list_jobs(include_finished=include_finished)

    def job(self, job_id: int) -> JobRecord:
        """The stored job, or NotFound."""
        return self.daemon.get_job(job_id)

    def owned_job(self, caller: Caller, job_id: int) -> JobRecord:
        """The job, if the caller may act on it; else NotFound or PermissionDenied."""
        job = self.daemon.get_job(job_id)
        if not caller.may_act_on(job.spec.uid):
            raise PermissionDenied(
                f"job {job_id} belongs to {job.spec.user}; {caller.user} may not act on it"
            )
        return job

    def events(self, job_id: int) -> list[EventRecord]:
        """The job's event log, oldest first."""
        return self.daemon.store.events(job_id)

    def live(self, job: JobRecord) -> LiveFacts:
        """Checkpoint settings, disk use and the newest checkpoint; live CPU and memory (recorded
        totals once ended); whether its processes are still being launched or restored."""
        daemon = self.daemon
        checkpoints, checkpoint_bytes = daemon.checkpoints.usage(job.id)
        usage = None
        if job.state.holds_devices and job.init_pid is not None:
            usage = daemon.processes.usage(job.init_pid)
        elif job.cpu_seconds is not None:
            usage = Usage(job.cpu_seconds, job.max_rss_bytes or 0)
        return LiveFacts(
            daemon.checkpoint_interval(job),
            checkpoints,
            checkpoint_bytes,
            usage,
            last_checkpoint=daemon.checkpoints.latest(job.id),
            starting=job.state.holds_devices and daemon.activity(job.id).launching,
            move=self.federation.move_facts(job.id),
        )

    def checkpoints(self, job_id: int) -> list[StoredCheckpoint]:
        """The job's checkpoint folders, complete or not."""
        return self.daemon.checkpoints.listing(job_id)

    def log_path(self, job_id: int, rank: int) -> Path:
        """Where a rank's output is written."""
        return self.daemon.processes.paths(job_id).rank_log(rank)

    def read_log(
        self, caller: Caller, job_id: int, rank: int, follow: bool, tail: int | None, offset: int
    ) -> AsyncIterator[tuple[int, bytes]]:
        """A rank's log from byte `offset` (else its last `tail` lines), then new output while
        following; each chunk with its offset. The caller and rank are checked first."""
        job = self.owned_job(caller, job_id)
        if not 0 <= rank < job.spec.ranks:
            raise InvalidRequest(f"job {job.id} has ranks 0 to {job.spec.ranks - 1}, not {rank}")
        if job.state is JobState.MOVED:
            raise StateConflict(f"job {job.id} {job.reason}: its output is there")

        def ended() -> bool:
            return _ended_here(self.daemon.get_job(job_id).state)

        return read_log(self.log_path(job_id, rank), follow=follow, tail=tail, offset=offset, ended=ended)

    async def devices(self) -> list[DeviceFacts]:
        """Each device with live memory use and utilisation (where reported), its jobs and its
        proxy's health; a virtual device's memory use is what its proxy server holds, and its
        utilisation the share of the last second that server spent running work (0 when idle)."""
        busy = self.daemon.store.busy_devices()
        devices = self.daemon.current_devices()
        health = await asyncio.gather(
            *(asyncio.to_thread(self.daemon.devices.health, device.index) for device in devices)
        )
        found = []
        for device, proxy in zip(devices, health, strict=True):
            if device.kind == "virtual":
                if proxy.allocated is not None:
                    device = replace(device, memory_used=proxy.allocated)
                if proxy.utilization_percent is not None or proxy.proxy in ("idle", "starting"):
                    device = replace(device, utilization_percent=proxy.utilization_percent or 0.0)
            found.append(DeviceFacts(device, [busy[device.index]] if device.index in busy else [], proxy))
        return found

    def subscribe(self) -> contextlib.AbstractContextManager[asyncio.Queue[int]]:
        """A queue of the ids of jobs that change while the context is open."""
        return self.daemon.feed.subscribe()

    async def wait_for_end(self, job_id: int) -> JobRecord:
        """Return the job once it has reached a terminal state, or moved to a peer."""
        with self.daemon.feed.subscribe() as changes:
            while True:
                job = self.daemon.get_job(job_id)
                if _ended_here(job.state):
                    return job
                while await changes.get() != job_id:
                    pass

    def info(self) -> DaemonFacts:
        """Facts for `sing doctor`."""
        daemon = self.daemon
        config, inventory, criu = daemon.config, daemon.inventory, daemon.checkpoints.status
        return DaemonFacts(
            version=__version__,
            mode="user" if config.user_mode else "system",
            socket=str(config.socket),
            state_dir=str(config.state_dir),
            device_kind=inventory.kind,
            device_count=len(inventory.devices),
            nvml_status=inventory.nvml_status,
            criu_unavailable_reason=criu.unavailable_reason,
            criu_path=criu.path,
            criu_version=criu.version,
            started_at=daemon.started_at,
            pid_namespaces=not config.user_mode,
            restore_guard_problem=criu.restore_guard_problem,
        )

    # Acting

    def submit(self, caller: Caller, args: SubmitArgs, anywhere: bool | None = None) -> JobRecord:
        """Validate and queue a job that will run as the caller.

        `anywhere` (None: the daemon's submit_anywhere) lets a job that cannot start here start on a
        peer with room. A draining node takes a job only to place it on a peer.
        """
        daemon, federation = self.daemon, self.federation
        elsewhere = daemon.config.submit_anywhere if anywhere is None else anywhere
        if federation.draining and not (elsewhere and federation.active):
            raise StateConflict(
                "this node is draining and takes no new jobs (--anywhere places one on a peer)"
            )
        spec = validated_spec(caller, args, len(daemon.inventory.devices))
        self._check_tier(caller, spec.tier)
        job = daemon.store.create_job(spec, daemon.clock(), f"submitted by {caller.user}")
        command = " ".join(args.command)
        log.info("job %d submitted by %s: %s", job.id, caller.user, command)
        daemon.feed.report(JobSubmitted(job.id, spec.user))
        daemon.feed.publish(job.id)
        daemon.request_schedule()
        if elsewhere:
            federation.place_elsewhere(job.id)
        return job

    def _check_tier(self, caller: Caller, tier: str) -> None:
        """Where the daemon names a premium_group, only its members, root and admins submit
        premium jobs (as a Slurm QOS is granted to some associations)."""
        group = self.daemon.config.premium_group
        if tier == PREMIUM and group and not (caller.is_admin or caller.in_group(group)):
            raise PermissionDenied(
                f"the premium tier is for members of {group}; {caller.user} may submit "
                "standard (the default) or basic jobs"
            )

    def _apply_now(self, job_id: int, stimulus: Stimulus) -> Decision:
        """Apply a user's request; a state that does not allow it is the user's error, not ours."""
        try:
            return self.daemon.apply(job_id, stimulus)
        except InvalidTransition as error:
            raise StateConflict(str(error)) from None

    async def _apply_once_started(self, job_id: int, stimulus: Stimulus) -> Decision:
        """Apply a request that needs the job's processes, waiting while they are being started
        and while a checkpoint already under way (a periodic one, another request's) ends, like
        `sing` commands queued behind each other; the job's state after that one decides."""
        for _ in range(CHECKPOINTS_WAITED_FOR):
            try:
                return self.daemon.apply(job_id, stimulus)
            except StillLaunching:
                await self.daemon.launched(job_id, self.launch_wait_seconds)
                break
            except CheckpointUnderway:
                await self.daemon.checkpoint_settled(job_id)
            except InvalidTransition as error:
                raise StateConflict(str(error)) from None
        return self._apply_now(job_id, stimulus)

    def cancel(self, caller: Caller, job_id: int) -> JobRecord:
        """Cancel a job: a queued one at once, a running one by signalling its processes."""
        self.owned_job(caller, job_id)
        self._apply_now(job_id, CancelRequested(caller.user))
        return self.daemon.get_job(job_id)

    async def preempt(self, caller: Caller, job_id: int, hold: bool) -> JobRecord:
        """Checkpoint and stop a running job (hold: until resumed by hand); returns once stopped."""
        self.owned_job(caller, job_id)
        decision = await self._apply_once_started(job_id, PreemptRequested(caller.user, hold=hold))
        if any(isinstance(action, TakeCheckpoint) for action in decision.actions):
            await self.daemon.checkpoint_outcome(job_id)
        return self.daemon.get_job(job_id)

    async def resize(self, caller: Caller, job_id: int, gpus: int) -> JobRecord:
        """Checkpoint a running job and stop it, to be restored on `gpus` devices; returns once stopped.

        Its processes see the same devices as before (splicing.py): only which device serves
        each of them changes. The job's new size is stored once its checkpoint is under way, and
        put back if the checkpoint fails (the job then runs on as it was)."""
        job = self.owned_job(caller, job_id)
        check_resize(job, gpus, len(self.daemon.inventory.devices))
        if gpus == job.spec.gpus:
            return job
        free = len(self.daemon.cluster_view().free_devices)
        if gpus > len(job.devices) + free:
            raise StateConflict(grow_refusal(job, gpus, free))
        decision = await self._apply_once_started(job_id, ResizeRequested(caller.user, gpus))
        if not any(isinstance(action, TakeCheckpoint) for action in decision.actions):
            return self.daemon.get_job(job_id)
        await self.daemon.follow_resize(job_id, gpus, job.spec.gpus)
        return self.daemon.get_job(job_id)

    def resume(self, caller: Caller, job_id: int) -> JobRecord:
        """Put a suspended job back in the queue."""
        self.owned_job(caller, job_id)
        self._apply_now(job_id, ResumeRequested(caller.user))
        return self.daemon.get_job(job_id)

    async def checkpoint(self, caller: Caller, job_id: int) -> tuple[JobRecord, CheckpointTaken]:
        """Checkpoint a running job in place; returns once the checkpoint is complete."""
        self.owned_job(caller, job_id)
        await self._apply_once_started(job_id, CheckpointRequested(caller.user))
        taken = await self.daemon.checkpoint_outcome(job_id)
        return self.daemon.get_job(job_id), taken

    # Lab clusters

    def _require_admin(self, caller: Caller, what: str) -> None:
        if not caller.is_admin:
            group = self.daemon.config.admin_group
            raise PermissionDenied(f"only root and members of {group} may {what}")

    async def cluster_init(self, caller: Caller, node_name: str, cluster_name: str) -> JoinInfo:
        """Make a lab CA here and certify this node (admins)."""
        self._require_admin(caller, "make a lab")
        return await self.federation.init(node_name, cluster_name)

    async def cluster_token(self, caller: Caller) -> JoinInfo:
        """A fresh join token (admins, on the node that made the lab CA)."""
        self._require_admin(caller, "make join tokens")
        return await self.federation.new_token()

    async def cluster_join(
        self, caller: Caller, address: str, token: str, fingerprint: str, node_name: str
    ) -> tuple[str, int, str]:
        """Join the lab whose CA node's join service is at `address` (admins)."""
        self._require_admin(caller, "join a lab")
        return await self.federation.join(address, token, fingerprint, node_name)

    def peers(self) -> PeersView:
        """This node's peers as heartbeats describe them."""
        return self.federation.peers()

    def migrate(self, caller: Caller, job_id: int, peer: str) -> AsyncIterator[MoveReport]:
        """Move one of the caller's running jobs to `peer`."""
        return self.federation.migrate(self.owned_job(caller, job_id), peer)

    def drain(self, caller: Caller) -> AsyncIterator[MoveReport]:
        """Refuse new jobs and move every job away (admins)."""
        self._require_admin(caller, "drain this node")
        return self.federation.drain()

    def undrain(self, caller: Caller) -> None:
        """Take jobs again (admins)."""
        self._require_admin(caller, "undrain this node")
        self.federation.undrain()

    async def cluster_jobs(self, include_finished: bool) -> ClusterJobs:
        """The jobs of this node and of every peer that answers."""
        return await self.federation.cluster_jobs(include_finished)


def _ended_here(state: JobState) -> bool:
    """Whether the job has ended, or lives on a peer now: nothing more of it happens here."""
    return state.is_terminal or state is JobState.MOVED
