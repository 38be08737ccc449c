"""Unit tests of the daemon's orchestration: the real Daemon, store and state machine, with fakes
for the job processes, the checkpoints and the devices (no root, no CRIU, milliseconds each).

Every long piece of work the fakes stand in for is held by a gate the test opens, so each test
decides the order of events itself: a process that exits while a checkpoint is under way, a
launch that never reports, a checkpoint that fails.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from singularityd.checkpoint.errors import CheckpointError
from singularityd.checkpoint.interface import (
    CheckpointTaken,
    CheckpointTarget,
    CriuStatus,
    PauseHooks,
    Restoration,
    StoredCheckpoint,
)
from singularityd.checkpoint.restoring import KnownDigests
from singularityd.config import Config
from singularityd.core.decisions import PREEMPTION_BACKOFF_SECONDS, Activity
from singularityd.core.states import JobState
from singularityd.daemon import Daemon
from singularityd.devices.access import DeviceHealth
from singularityd.devices.inventory import Inventory, virtual_devices
from singularityd.devices.proxies import ProxyConnection, Reconnection
from singularityd.devices.proxy_servers import JobIdentity
from singularityd.errors import StateConflict
from singularityd.identity import Caller
from singularityd.jobs.paths import JobPaths
from singularityd.jobs.processes import ExitStatus, ProcessId, Usage
from singularityd.jobs.submission import SubmitArgs
from singularityd.requests import Requests
from singularityd.store import JobRecord, Store

ROOT = Caller(uid=0, user="root", connection_gid=0, admin_group="")


class Clock:
    """Time that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeWatch:
    """A watched supervisor: the signals sent to it, and the callback its end triggers."""

    pid: int
    on_exit: Callable[[], None]
    signals: list[int] = field(default_factory=list)
    closed: bool = False

    def signal(self, sig: int) -> bool:
        self.signals.append(sig)
        return not self.closed

    def close(self) -> None:
        self.closed = True


class FakeProcesses:
    """Job processes that exist only here: launches wait for the test's gate when it sets one."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.next_pid = 100
        self.launch_gate: asyncio.Future[None] | None = None
        self.watches: dict[int, FakeWatch] = {}
        self.statuses: dict[int, ExitStatus] = {}
        self.launched: list[int] = []

    def paths(self, job_id: int) -> JobPaths:
        return JobPaths(self.root / str(job_id))

    async def launch(self, job: JobRecord, device_env: Mapping[str, str]) -> ProcessId:
        if self.launch_gate is not None:
            await self.launch_gate
        self.next_pid += 1
        self.launched.append(job.id)
        return ProcessId(self.next_pid, 1)

    def watch(self, pid: int, on_exit: Callable[[], None]) -> FakeWatch:
        self.watches[pid] = FakeWatch(pid, on_exit)
        return self.watches[pid]

    def end(self, pid: int, job_id: int, exit_code: int | None = 0, sig: int | None = None) -> None:
        """The supervisor records how the job ended, then ends."""
        self.statuses[job_id] = ExitStatus(exit_code, sig, "", 1.0, 1024)
        watch = self.watches[pid]
        if not watch.closed:
            watch.closed = True
            watch.on_exit()

    def exit_status(self, job_id: int) -> ExitStatus | None:
        return self.statuses.get(job_id)

    def recorded(self, job_id: int) -> ProcessId | None:
        return None

    def alive(self, process: ProcessId) -> bool:
        watch = self.watches.get(process.pid)
        return watch is not None and not watch.closed

    def usage(self, pid: int) -> Usage | None:
        return None

    def forget_outcome(self, job_id: int) -> None:
        self.statuses.pop(job_id, None)

    def adopt_restored(self, job_id: int, pid: int) -> ProcessId:
        return ProcessId(pid, 2)


class FakeCheckpoints:
    """Checkpoints that take as long as the test holds their gate, and fail when it says so."""

    def __init__(self) -> None:
        self.status = CriuStatus("criu", "4.2", "")
        self.stored: dict[int, int] = {}
        self.taken: list[tuple[int, bool, str]] = []
        self.gate: asyncio.Future[str] | None = None

    @property
    def available(self) -> bool:
        return True

    def has_checkpoint(self, job_id: int) -> bool:
        return job_id in self.stored

    def usage(self, job_id: int) -> tuple[int, int]:
        return (1, 100) if job_id in self.stored else (0, 0)

    def listing(self, job_id: int) -> list[StoredCheckpoint]:
        return []

    def latest(self, job_id: int) -> StoredCheckpoint | None:
        return None

    def hold(self) -> asyncio.Future[str]:
        """Make the next checkpoint wait; resolve with '' to complete it, or an error to fail it."""
        self.gate = asyncio.get_running_loop().create_future()
        return self.gate

    async def take(
        self,
        target: CheckpointTarget,
        *,
        stop: bool,
        reason: str,
        hooks: PauseHooks | None = None,
        purpose: Mapping[str, Any] | None = None,
    ) -> CheckpointTaken:
        self.taken.append((target.job_id, stop, reason))
        error = await self.gate if self.gate is not None else ""
        self.gate = None
        if error:
            raise CheckpointError(error)
        seq = self.stored[target.job_id] = self.stored.get(target.job_id, 0) + 1
        return CheckpointTaken(seq, 0.0, 100, 0.01, f"checkpoint {seq} (100B)")

    async def restore(
        self,
        job_id: int,
        devices: tuple[int, ...],
        logical: int | None = None,
        known_digests: KnownDigests | None = None,
        user: JobIdentity | None = None,
    ) -> Restoration:
        return Restoration(500 + job_id, self.stored[job_id], ((9, "no manifest"),))

    async def settle_interrupted(self, job_id: int) -> str:
        return ""

    def discard(self, job_id: int, shared_memory: bool = False) -> int:
        """The job ended: its checkpoints go."""
        return 100 if self.stored.pop(job_id, None) is not None else 0

    def close(self) -> None:
        """Nothing is held."""


@dataclass
class FakeDevices:
    """Device access that only records what the daemon asked of it."""

    calls: list[tuple[str, int]] = field(default_factory=list)
    retained: set[int] = field(default_factory=set)
    verdict: dict[str, Any] = field(default_factory=dict)
    """What every device says of a job's ranks when asked whether they are replicas."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    async def admit(
        self, job_id: int, identity: JobIdentity, devices: Sequence[int], logical: int | None = None
    ) -> None:
        self.calls.append(("admit", job_id))

    def forget(self, job_id: int) -> None:
        self.calls.append(("forget", job_id))

    def retain(self, job_ids: set[int]) -> None:
        self.retained = set(job_ids)

    def environment(
        self,
        job_id: int,
        devices: Sequence[int],
        inherited_pythonpath: str | None,
        logical: int | None = None,
    ) -> dict[str, str]:
        return {}

    def connections(self, pids: Sequence[int]) -> list[ProxyConnection]:
        return []

    async def quiesce_and_save(self, job_id: int, devices: Sequence[int], images: Path) -> None: ...

    async def resume(self, job_id: int, devices: Sequence[int]) -> None:
        self.calls.append(("resume", job_id))

    async def release(self, job_id: int, devices: Sequence[int]) -> None: ...

    def reconnect(
        self,
        job_id: int,
        devices: Sequence[int],
        images: Path,
        connections: Sequence[Mapping[str, int]],
        layout: object = None,
    ) -> Reconnection:
        return Reconnection({}, [])

    async def preload(self, job_id: int, devices: Sequence[int], images: Path) -> list[dict[str, Any]]:
        return []

    def health(self, device: int) -> DeviceHealth:
        return DeviceHealth("")

    def lost(self, job_id: int) -> str:
        return ""

    async def verdicts(self, job_id: int, devices: Sequence[int]) -> list[dict[str, Any]]:
        self.calls.append(("verdicts", job_id))
        return [self.verdict for _ in devices]


@dataclass
class Harness:
    """A daemon on fakes, with the requests layer the API would call."""

    daemon: Daemon
    requests: Requests
    processes: FakeProcesses
    checkpoints: FakeCheckpoints
    devices: FakeDevices
    clock: Clock
    cwd: str

    def submit(self, priority: int = 0) -> int:
        args = SubmitArgs(("train",), "", 1, priority, 1, self.cwd, {})
        return self.requests.submit(ROOT, args).id

    def job(self, job_id: int) -> JobRecord:
        return self.daemon.get_job(job_id)

    def reasons(self, job_id: int) -> list[str]:
        return [event.reason for event in self.daemon.store.events(job_id)]

    def pid(self, job_id: int) -> int:
        pid = self.job(job_id).init_pid
        assert pid is not None
        return pid


async def settle() -> None:
    """Let every ready callback and task run until nothing is left to do now."""
    for _ in range(20):
        await asyncio.sleep(0)


async def checkpoints_removed(h: Harness, job: int) -> None:
    """Wait until the daemon has removed an ended job's checkpoints (in a thread) and said so."""
    for _ in range(500):
        if job not in h.checkpoints.stored and "checkpoints were removed" in h.reasons(job)[-1]:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"job {job}'s checkpoints were not removed: {h.reasons(job)[-3:]}")


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    config = Config(socket=tmp_path / "sing.sock", state_dir=tmp_path)
    clock = Clock()
    processes = FakeProcesses(tmp_path / "jobs")
    checkpoints = FakeCheckpoints()
    devices = FakeDevices()
    inventory = Inventory(virtual_devices(1, 1.0), "not used")
    store = Store(tmp_path / "singularity.db")
    daemon = Daemon(config, store, inventory, processes, checkpoints, devices, clock)  # type: ignore[arg-type]
    await daemon.start()
    requests = Requests(daemon, launch_wait_seconds=0.05)
    yield Harness(daemon, requests, processes, checkpoints, devices, clock, str(tmp_path))
    await daemon.stop()


T = TypeVar("T")


async def started(request: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """A request begun and left waiting where it waits (nothing else is ready to run)."""
    future = asyncio.ensure_future(request)
    await settle()
    return future


async def running_job(h: Harness, priority: int = 0) -> int:
    job = h.submit(priority)
    await settle()
    assert h.job(job).state is JobState.RUNNING and h.job(job).init_pid is not None
    return job


# A job that exits during a checkpoint


async def test_an_exit_during_an_in_place_checkpoint_is_recorded_after_it(harness: Harness) -> None:
    h = harness
    job = await running_job(h)
    gate = h.checkpoints.hold()
    request = await started(h.requests.checkpoint(ROOT, job))
    h.processes.end(h.pid(job), job, exit_code=0)
    await settle()
    assert h.job(job).state is JobState.RUNNING, "the exit waits for the checkpoint"
    assert h.daemon.activity(job).deferred_exit is not None
    gate.set_result("")
    record, taken = await request
    assert taken.seq == 1 and record.state is JobState.COMPLETED
    await checkpoints_removed(h, job)
    assert h.reasons(job)[-3:] == [
        "checkpoint by root: checkpoint 1 (100B)",
        "exited with code 0",
        "its checkpoints were removed (100B): a job that has ended never resumes",
    ]
    assert job not in h.daemon.records and ("forget", job) in h.devices.calls


async def test_an_exit_during_a_failed_checkpoint_is_recorded_and_the_request_told(harness: Harness) -> None:
    h = harness
    job = await running_job(h)
    gate = h.checkpoints.hold()
    request = await started(h.requests.checkpoint(ROOT, job))
    h.processes.end(h.pid(job), job, exit_code=3)
    await settle()
    gate.set_result("the process tree vanished")
    with pytest.raises(StateConflict, match=f"^job {job} ended while it was being checkpointed$"):
        await request
    assert h.job(job).state is JobState.FAILED and h.job(job).exit_code == 3
    assert h.reasons(job)[-2:] == [
        "the job ended during its checkpoint (checkpoint by root): none taken",
        "exited with code 3",
    ]


async def test_the_exit_a_preemption_causes_does_not_end_the_job(harness: Harness) -> None:
    h = harness
    job = await running_job(h)
    gate = h.checkpoints.hold()
    request = await started(h.requests.preempt(ROOT, job, hold=False))
    h.processes.end(h.pid(job), job, exit_code=None, sig=signal.SIGKILL)  # CRIU ends the dumped tree
    gate.set_result("")
    await request
    await settle()
    assert h.job(job).state is JobState.RUNNING, "preempted, then resumed on the free device"
    states = [(e.to_state, e.reason) for e in h.daemon.store.events(job)][-4:]
    assert states == [
        (JobState.PREEMPTED, "preempted by root: checkpoint 1 (100B); queued to resume"),
        (JobState.RUNNING, "resumed from its checkpoint on device 0"),
        (JobState.RUNNING, "checkpoint 9 not used: no manifest"),
        (JobState.RUNNING, "restored from checkpoint 1"),
    ]
    assert h.job(job).init_pid == 500 + job


# A checkpoint that fails


async def test_a_failed_checkpoint_leaves_the_job_running_and_checkpointable(harness: Harness) -> None:
    h = harness
    job = await running_job(h)
    gate = h.checkpoints.hold()
    request = await started(h.requests.checkpoint(ROOT, job))
    gate.set_result("No space left on device")
    with pytest.raises(StateConflict, match="checkpoint failed: No space left on device"):
        await request
    assert h.job(job).state is JobState.RUNNING
    assert h.reasons(job)[-1] == "checkpoint failed, the job keeps running: No space left on device"
    assert h.daemon.activity(job) == Activity()
    _, taken = await h.requests.checkpoint(ROOT, job)
    assert taken.seq == 1


async def test_a_request_during_a_checkpoint_waits_for_it_then_acts(harness: Harness) -> None:
    h = harness
    job = await running_job(h)
    gate = h.checkpoints.hold()
    first = await started(h.requests.checkpoint(ROOT, job))
    second = await started(h.requests.preempt(ROOT, job, hold=True))
    assert not second.done(), "the suspend waits while the checkpoint is taken"
    assert [taken[1] for taken in h.checkpoints.taken] == [False]
    gate.set_result("")
    _, taken = await asyncio.wait_for(first, 1.0)
    assert taken.seq == 1
    assert (await asyncio.wait_for(second, 1.0)).state is JobState.SUSPENDED
    assert h.checkpoints.taken == [
        (job, False, "checkpoint by root"),
        (job, True, "suspended by root"),
    ]


async def test_a_request_waiting_for_a_checkpoint_that_stops_the_job_is_refused_after_it(
    harness: Harness,
) -> None:
    h = harness
    job = await running_job(h)
    gate = h.checkpoints.hold()
    suspend = await started(h.requests.preempt(ROOT, job, hold=True))
    checkpoint = await started(h.requests.checkpoint(ROOT, job))
    assert not checkpoint.done()
    gate.set_result("")
    await asyncio.wait_for(suspend, 1.0)
    with pytest.raises(StateConflict, match="is SUSPENDED; only a RUNNING job can be checkpointed"):
        await asyncio.wait_for(checkpoint, 1.0)
    assert len(h.checkpoints.taken) == 1


async def test_a_client_giving_up_does_not_stop_the_checkpoint(harness: Harness) -> None:
    h = harness
    job = await running_job(h)
    gate = h.checkpoints.hold()
    request = await started(h.requests.preempt(ROOT, job, hold=True))
    request.cancel()
    await settle()
    gate.set_result("")
    await settle()
    assert h.job(job).state is JobState.SUSPENDED
    assert h.reasons(job)[-1] == "suspended by root: checkpoint 1 (100B); held until resumed"


# A launch that never reports


async def test_a_launch_that_never_reports(harness: Harness) -> None:
    h = harness
    h.processes.launch_gate = asyncio.get_running_loop().create_future()
    job = h.submit()
    await settle()
    assert h.job(job).state is JobState.RUNNING and h.job(job).init_pid is None
    assert h.daemon.activity(job).launching
    with pytest.raises(StateConflict, match=f"job {job} is still starting"):
        await h.requests.preempt(ROOT, job, hold=False)
    urgent = h.submit(priority=10)
    await settle()
    assert h.checkpoints.taken == [], "a job still starting is never preempted"
    assert h.job(urgent).pending_reason == "Resources: needs 1 device, 0 free"
    h.requests.cancel(ROOT, job)
    assert h.job(job).cancel_requested and h.job(job).state is JobState.RUNNING


async def test_a_request_waiting_for_a_launch_goes_on_once_it_reports(harness: Harness) -> None:
    h = harness
    h.requests.launch_wait_seconds = 60.0
    gate = h.processes.launch_gate = asyncio.get_running_loop().create_future()
    job = h.submit()
    await settle()
    request = await started(h.requests.checkpoint(ROOT, job))
    assert not request.done()
    gate.set_result(None)
    _, taken = await asyncio.wait_for(request, 1.0)
    assert taken.seq == 1


async def test_a_cancel_during_the_launch_stops_the_processes_once_they_run(harness: Harness) -> None:
    h = harness
    gate = h.processes.launch_gate = asyncio.get_running_loop().create_future()
    job = h.submit()
    await settle()
    h.requests.cancel(ROOT, job)
    gate.set_result(None)
    await settle()
    assert h.processes.watches[h.pid(job)].signals == [signal.SIGTERM]
    h.processes.end(h.pid(job), job, exit_code=None, sig=signal.SIGTERM)
    await settle()
    assert h.job(job).state is JobState.CANCELLED


# A scheduler preemption that fails and backs off


async def test_a_failed_scheduler_preemption_backs_off_then_retries(harness: Harness) -> None:
    h = harness
    low = await running_job(h, priority=0)
    gate = h.checkpoints.hold()
    high = h.submit(priority=10)
    await settle()
    assert h.checkpoints.taken == [(low, True, f"preempted for job {high}, which outranks it")]
    gate.set_result("CRIU cannot dump an io_uring")
    await settle()
    backoff = h.clock.now + PREEMPTION_BACKOFF_SECONDS
    assert h.daemon.activity(low) == Activity(preemption_backoff_until=backoff)
    assert h.job(low).state is JobState.RUNNING and h.job(high).state is JobState.PENDING
    assert h.job(high).pending_reason == "Resources: needs 1 device, 0 free"

    h.clock.now = backoff - 1
    h.daemon.request_schedule()
    await settle()
    assert len(h.checkpoints.taken) == 1, "no new attempt during the back-off"

    h.clock.now = backoff
    h.daemon.request_schedule()
    await settle()
    assert len(h.checkpoints.taken) == 2
    assert h.job(low).state is JobState.PREEMPTED and h.job(high).state is JobState.RUNNING
    assert low not in h.daemon.records, "the back-off went with the job's runtime record"
    assert h.daemon.activity(low) == Activity()


async def test_a_job_that_ends_during_its_back_off_leaves_nothing_behind(harness: Harness) -> None:
    h = harness
    low = await running_job(h, priority=0)
    gate = h.checkpoints.hold()
    h.submit(priority=10)
    await settle()
    gate.set_result("CRIU failed")
    await settle()
    assert h.daemon.activity(low).preemption_backoff_until is not None
    h.processes.end(h.pid(low), low, exit_code=0)
    await settle()
    assert h.job(low).state is JobState.COMPLETED
    assert h.daemon.records.keys() == {low + 1}, "only the job that took the device has a record"


# Periodic checkpoints and recovery


async def test_periodic_checkpoints_follow_one_another(harness: Harness) -> None:
    h = harness
    args = SubmitArgs(("train",), "", 1, 0, 1, h.cwd, {}, checkpoint_interval=0.01)
    job = h.requests.submit(ROOT, args).id
    for _ in range(500):  # each checkpoint arms the next; wait for two (at most 5 s)
        if len(h.checkpoints.taken) >= 2:
            break
        await asyncio.sleep(0.01)
    assert h.checkpoints.taken[:2] == [(job, False, "periodic checkpoint")] * 2
    assert h.reasons(job)[-1].startswith("periodic checkpoint: checkpoint ")
    record = h.daemon.records[job]
    h.processes.end(h.pid(job), job, exit_code=0)
    await settle()
    assert job not in h.daemon.records and record.periodic is None, "no checkpoint after the end"


async def test_recovery_settles_jobs_that_ended_or_never_started(harness: Harness) -> None:
    h = harness
    gate = h.processes.launch_gate = asyncio.get_running_loop().create_future()
    job = h.submit()
    await settle()
    gate.cancel()
    await h.daemon.recover()  # as if the daemon had restarted before the launcher answered
    assert h.job(job).state is JobState.PENDING
    assert h.reasons(job)[-1] == "launch interrupted by a daemon restart; queued again"
