"""What the API layer needs of the daemon: the one interface the gRPC servicer depends on.

singularityd.requests.Requests implements it over the real daemon; anything else that does (a
simulator's fake cluster, a test double) can be served by the same servicer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from singularityd.checkpoint.interface import CheckpointTaken, StoredCheckpoint
from singularityd.devices.access import DeviceHealth
from singularityd.devices.inventory import Device
from singularityd.federation.facts import ClusterJobs, JoinInfo, MoveFacts, MoveReport, PeersView
from singularityd.identity import Caller
from singularityd.jobs.processes import Usage
from singularityd.jobs.submission import SubmitArgs
from singularityd.store import EventRecord, JobRecord


@dataclass(frozen=True)
class LiveFacts:
    """What a job listing shows beside the stored job: checkpoint settings and use, the newest
    checkpoint, live usage, and whether its processes are still being launched or restored."""

    checkpoint_interval: float
    checkpoints: int
    checkpoint_bytes: int
    usage: Usage | None
    last_checkpoint: StoredCheckpoint | None = None
    starting: bool = False
    move: MoveFacts | None = None


@dataclass(frozen=True)
class DeviceFacts:
    """A device as a listing shows it: live memory and utilisation, the jobs holding it, and how
    its proxy server is doing."""

    device: Device
    jobs: list[int]
    health: DeviceHealth


@dataclass(frozen=True)
class DaemonFacts:
    """The daemon's own facts, for `sing doctor`."""

    version: str
    mode: str
    socket: str
    state_dir: str
    device_kind: str
    device_count: int
    nvml_status: str
    criu_unavailable_reason: str
    criu_path: str
    criu_version: str
    started_at: float
    pid_namespaces: bool
    restore_guard_problem: str


class JobService(Protocol):
    """The daemon as the API sees it; refusals are singularityd.errors.RequestError subclasses."""

    def jobs(self, include_finished: bool) -> list[JobRecord]:
        """The live jobs, or all of them."""

    def job(self, job_id: int) -> JobRecord:
        """One job (NotFound if unknown)."""

    def owned_job(self, caller: Caller, job_id: int) -> JobRecord:
        """One job the caller may act on (NotFound, PermissionDenied)."""

    def events(self, job_id: int) -> list[EventRecord]:
        """The job's event log, oldest first."""

    def live(self, job: JobRecord) -> LiveFacts:
        """Checkpoint settings and use, live usage."""

    def checkpoints(self, job_id: int) -> list[StoredCheckpoint]:
        """The job's checkpoint folders."""

    def log_path(self, job_id: int, rank: int) -> Path:
        """Where a rank's output is written."""

    def read_log(
        self, caller: Caller, job_id: int, rank: int, follow: bool, tail: int | None, offset: int
    ) -> AsyncIterator[tuple[int, bytes]]:
        """A rank's log from byte `offset` (else its last `tail` lines), then new output while
        following; each chunk with the offset it starts at (checked before the first chunk)."""

    async def devices(self) -> list[DeviceFacts]:
        """Each device, the jobs holding it and its proxy's health."""

    def subscribe(self) -> contextlib.AbstractContextManager[asyncio.Queue[int]]:
        """A queue of the ids of jobs that change while open."""

    async def wait_for_end(self, job_id: int) -> JobRecord:
        """The job once it has ended, or moved to a peer."""

    def info(self) -> DaemonFacts:
        """The daemon's own facts."""

    def submit(self, caller: Caller, args: SubmitArgs, anywhere: bool | None = None) -> JobRecord:
        """Queue a job for the caller (anywhere: a peer with room may run it; None: the default)."""

    def cancel(self, caller: Caller, job_id: int) -> JobRecord:
        """Cancel a job."""

    async def preempt(self, caller: Caller, job_id: int, hold: bool) -> JobRecord:
        """Checkpoint and stop a job (hold: until resumed)."""

    async def resize(self, caller: Caller, job_id: int, gpus: int) -> JobRecord:
        """Checkpoint a running job and stop it, to be restored on `gpus` devices."""

    def resume(self, caller: Caller, job_id: int) -> JobRecord:
        """Queue a suspended job again."""

    async def checkpoint(self, caller: Caller, job_id: int) -> tuple[JobRecord, CheckpointTaken]:
        """Checkpoint a job in place."""

    async def cluster_init(self, caller: Caller, node_name: str, cluster_name: str) -> JoinInfo:
        """Make a lab CA here (admins)."""

    async def cluster_token(self, caller: Caller) -> JoinInfo:
        """A fresh join token (admins, on the CA node)."""

    async def cluster_join(
        self, caller: Caller, address: str, token: str, fingerprint: str, node_name: str
    ) -> tuple[str, int, str]:
        """Join a lab (admins): this node's name and number, and the CA node."""

    def peers(self) -> PeersView:
        """This node's peers."""

    def migrate(self, caller: Caller, job_id: int, peer: str) -> AsyncIterator[MoveReport]:
        """Move a job to a peer; its progress, then how it ended (refusals before the first)."""

    def drain(self, caller: Caller) -> AsyncIterator[MoveReport]:
        """Refuse new jobs and move every job away (admins)."""

    def undrain(self, caller: Caller) -> None:
        """Take jobs again (admins)."""

    async def cluster_jobs(self, include_finished: bool) -> ClusterJobs:
        """The jobs of every node of the lab that answers."""
