"""The daemon's core: turns what happens into stimuli, records each decision, carries it out.

Requests, process exits and the outcomes of long work (launch, restore, checkpoint) all become
stimuli for the pure job state machine (singularityd.core.decisions). The daemon records the
transition it returns in the store first, keeps the job's activity in the job's runtime record,
then carries out the actions in order; long work runs as a task that reports its outcome as the
next stimulus. Jobs outlive the daemon: on start it re-adopts the ones still running.

The parts it drives are injected (see singularityd.__main__): the job processes, the
checkpoints and the device access, each behind a small interface a test can fake.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from asyncio import Future
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

from singularityd.checkpoint.errors import CheckpointError
from singularityd.checkpoint.interface import Checkpoints, CheckpointTaken, PauseHooks
from singularityd.config import Config
from singularityd.core.actions import (
    Action,
    ArmPeriodicCheckpoint,
    CountRestart,
    DiscardCheckpoints,
    LaunchProcesses,
    MarkCancelRequested,
    Note,
    ReleaseDevices,
    Replay,
    Reschedule,
    RescheduleAfter,
    RestoreProcesses,
    TakeCheckpoint,
    TerminateProcesses,
    WatchProcesses,
)
from singularityd.core.decisions import Activity, Decision, JobFacts, StillLaunching, decide
from singularityd.core.lost_processes import NewestCheckpoint, StopPurpose, after_lost_processes
from singularityd.core.states import TERMINAL_STATES, InvalidTransition, JobState, Transition
from singularityd.core.stimuli import (
    Arrived,
    Exited,
    LaunchFailed,
    PeriodicCheckpointDue,
    PreemptionWanted,
    ProcessesLost,
    ProcessesRunning,
    Requeued,
    ResizeRequested,
    RestoreFailed,
    Started,
    Stimulus,
)
from singularityd.devices.access import DeviceAccess, DeviceError
from singularityd.devices.inventory import Device, Inventory, refresh
from singularityd.errors import StateConflict, StoreUnwritable, not_found
from singularityd.jobs import work
from singularityd.jobs.processes import Processes, ProcessId, missing_status_reason
from singularityd.jobs.record import JobRuntime
from singularityd.observe.feed import ChangeFeed, JobDecided, RoundPlanned
from singularityd.scheduling.round import ClusterView, JobView, plan_round
from singularityd.store import JobRecord, Store
from singularityd.units import human_bytes

log = logging.getLogger("singularityd")

KILL_BACKSTOP_SECONDS = 2.0
STORE_RETRY_SECONDS = 2.0
"""How soon an event the state database could not record is fed to the state machine again."""
GROW_ROUND_MARGIN_SECONDS = 0.5
"""While an elastic job could grow into idle devices, a round comes this much after they have been
idle long enough (clocks differ slightly), and again after as long while the job is busy."""


class Daemon:
    """The running daemon: the store, the jobs' runtime records, and the parts that act on jobs."""

    def __init__(
        self,
        config: Config,
        store: Store,
        inventory: Inventory,
        processes: Processes,
        checkpoints: Checkpoints,
        devices: DeviceAccess,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.store = store
        self.inventory = inventory
        self.processes = processes
        self.checkpoints = checkpoints
        self.devices = devices
        self.clock = clock
        self.started_at = clock()
        self.feed = ChangeFeed()
        self.holding_queue = ""
        """Why the scheduler starts no queued job here ('' when it may), e.g. the node is draining."""
        self.records: dict[int, JobRuntime] = {}
        self.move_pause_hooks: dict[int, PauseHooks] = {}
        """Per job being moved: what its final checkpoint runs before its pause and once dumped."""
        self.reserved_devices: Callable[[], set[int]] = set
        """Devices no job here may take now: those holding the device state preloaded for jobs
        arriving from peers (federation sets it)."""
        self._schedule_requested = False
        self._timers: set[asyncio.TimerHandle] = set()
        self._idle_since: float | None = None
        self._grow_round_due = False
        self._tasks: set[asyncio.Task[Any]] = set()

    # Start and stop

    async def start(self) -> None:
        """Get the devices ready, re-adopt or settle the jobs of a previous run, schedule."""
        self.devices.start()
        await self.recover()
        self.request_schedule()

    async def stop(self) -> None:
        """Stop acting and close the checkpoints and the store; jobs keep running and are re-adopted
        on restart."""
        self.devices.stop()
        for record in self.records.values():
            record.close()
        for timer in self._timers:
            timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        self.checkpoints.close()
        self.store.close()

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run long work as a task the daemon keeps (and cancels when it stops)."""
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background work failed", exc_info=task.exception())

    def _later(self, seconds: float, callback: Callable[[], None]) -> None:
        """Call back after `seconds`, unless the daemon stops first."""

        def fire() -> None:
            self._timers.discard(timer)
            callback()

        timer = asyncio.get_running_loop().call_later(seconds, fire)
        self._timers.add(timer)

    # Recovery

    async def recover(self) -> None:
        """Re-adopt jobs whose processes still run; settle those that ended while we were down.

        MIGRATING jobs are left to the hand-off records (singularityd.federation), which alone
        know whether such a job runs here, elsewhere, or nowhere yet.
        """
        for job in self.store.list_jobs(states=(JobState.RUNNING,)):
            try:
                settled = await self.checkpoints.settle_interrupted(job.id)
            except CheckpointError as error:
                settled = f"an interrupted checkpoint could not be settled: {error}"
            if settled:
                self.store.add_note(job.id, job.state, settled, self.clock())
            process: ProcessId | None = None
            if job.init_pid is not None and job.init_start_ticks is not None:
                process = ProcessId(job.init_pid, job.init_start_ticks)
            else:
                process = self.processes.recorded(job.id)
                if process is not None:
                    self.store.set_process(job.id, process.pid, process.start_ticks)
            if process is not None and self.processes.alive(process):
                log.info("re-adopted job %d (supervisor pid %d)", job.id, process.pid)
                self.apply(job.id, ProcessesRunning(process.pid, process.start_ticks))
                # A daemon killed in mid-checkpoint may have left the job parked in its proxies.
                with contextlib.suppress(DeviceError):
                    await self.devices.resume(job.id, job.devices)
                continue
            status = self.processes.exit_status(job.id)
            if status is not None:
                self.apply(job.id, status.as_stimulus())
            elif process is None:
                self.apply(job.id, Requeued("launch interrupted by a daemon restart; queued again"))
            else:
                self._settle_lost(job)
        holding = self.store.list_jobs(states=(JobState.RUNNING, JobState.MIGRATING))
        self.devices.retain({job.id for job in holding})
        self.spawn(self._discard_ended_jobs_checkpoints())

    async def _discard_ended_jobs_checkpoints(self) -> None:
        """Remove the checkpoints that jobs which ended before this start still hold (the daemon
        stopped before it removed them, or a version that kept them ran), as their end would have."""
        for job in self.store.list_jobs(states=TERMINAL_STATES):
            await self._discard_checkpoints(job.id, job.state)

    def _settle_lost(self, job: JobRecord) -> None:
        """A RUNNING job's processes ended without an exit status while the daemon was down: the
        stop its newest checkpoint completed, when the daemon died before recording it; else lost."""
        detail = "the job's processes ended while the daemon was down, without an exit status"
        latest = self.checkpoints.latest(job.id)
        newest = None
        if latest is not None:
            newest = NewestCheckpoint(latest.seq, latest.created_at, StopPurpose.from_dict(latest.stop))
        began = [
            e.at
            for e in self.store.events(job.id)
            if e.to_state is JobState.RUNNING and e.from_state is not JobState.RUNNING
        ]
        outcome = after_lost_processes(newest, max(began, default=None), detail, job.cancel_requested)
        if isinstance(outcome, ProcessesLost):
            self.apply(job.id, outcome)
            return
        log.warning("job %d: %s", job.id, outcome.outcome.summary)
        if outcome.gpus:
            self.store.set_gpus(job.id, outcome.gpus)
        self.records.setdefault(job.id, JobRuntime(job.id)).update(Activity(checkpoint=outcome.take))
        self.apply(job.id, outcome.outcome)

    # Decisions

    def get_job(self, job_id: int) -> JobRecord:
        """The stored job, or NotFound."""
        job = self.store.get(job_id)
        if job is None:
            raise not_found(job_id)
        return job

    def checkpoint_interval(self, job: JobRecord) -> float:
        """The job's own periodic checkpoint interval, else the daemon's default (0: none)."""
        if job.spec.checkpoint_interval is not None:
            return job.spec.checkpoint_interval
        return self.config.checkpoint_interval_seconds

    def current_devices(self) -> tuple[Device, ...]:
        """The devices, with live memory use and utilisation where the hardware reports them."""
        self.inventory = refresh(self.inventory)
        return self.inventory.devices

    def activity(self, job_id: int) -> Activity:
        """What is under way with the job's processes (nothing for a job holding no devices)."""
        record = self.records.get(job_id)
        return record.activity if record is not None else Activity()

    def apply(self, job_id: int, stimulus: Stimulus, happened: bool = False) -> Decision:
        """Feed one stimulus to the state machine, record the result, carry out its actions
        (`happened`: it reports something that happened to the job, which a note the state
        database cannot take does not stop; a request is refused whole).

        Raises NotFound for an unknown job, and the state machine's InvalidTransition when the
        job's state does not allow the stimulus (nothing is changed then).
        """
        job = self.get_job(job_id)
        facts = JobFacts(
            job.id,
            job.state,
            job.cancel_requested,
            has_checkpoint=self.checkpoints.has_checkpoint(job.id),
            checkpoints_available=self.checkpoints.available,
            checkpoint_interval=self.checkpoint_interval(job),
            activity=self.activity(job_id),
            max_restarts=job.spec.max_restarts,
            restarts_used=job.restarts_used,
            last_checkpoint=self._restart_point(job, stimulus),
        )
        decision = decide(facts, stimulus, self.clock())
        state = job.state
        if decision.transition is not None:
            self._record(decision.transition, stimulus)
            state = decision.transition.to_state
        if decision.activity is not None:
            self.records.setdefault(job_id, JobRuntime(job_id)).update(decision.activity)
        self.feed.report(JobDecided(job_id, job.spec.user, job.state, facts.activity, stimulus, decision))
        try:
            for action in decision.actions:
                self._carry_out(job, state, action, happened)
        except Exception as error:
            # what was not carried out is not under way: a checkpoint refused by a full state
            # database must not leave the job "already being checkpointed" for good
            if decision.activity is not None and job_id in self.records:
                self.records[job_id].update(facts.activity)
            log.warning("job %d: %s not carried out: %s", job_id, type(stimulus).__name__, error)
            raise
        self.feed.publish(job_id)
        return decision

    def _restart_point(self, job: JobRecord, stimulus: Stimulus) -> int | None:
        """The newest complete checkpoint a failed job with restarts left would resume from."""
        if not isinstance(stimulus, Exited) or job.restarts_used >= job.spec.max_restarts:
            return None
        latest = self.checkpoints.latest(job.id)
        return latest.seq if latest is not None else None

    def _record(self, transition: Transition, stimulus: Stimulus) -> None:
        """Write a transition to the store, with the devices or exit status it carries."""
        ended = stimulus if isinstance(stimulus, Exited) else None
        self.store.record_transition(
            transition,
            devices=stimulus.devices if isinstance(stimulus, Started | Arrived) else None,
            exit_code=ended.exit_code if ended else None,
            signal=ended.signal if ended else None,
            cpu_seconds=ended.cpu_seconds if ended else None,
            max_rss_bytes=ended.max_rss_bytes if ended else None,
        )
        job_id, before, after = transition.job_id, transition.from_state, transition.to_state
        log.info("job %d: %s -> %s (%s)", job_id, before, after, transition.reason)

    def _carry_out(self, job: JobRecord, state: JobState, action: Action, happened: bool) -> None:
        """Carry out one decided action for the job (now in `state`; `happened`: for something
        that happened to it, not a request)."""
        record = self.records.get(job.id)
        match action:
            case MarkCancelRequested():
                self.store.set_cancel_requested(job.id)
            case CountRestart():
                self.store.count_restart(job.id)
            case DiscardCheckpoints(without_processes=without_processes):
                self.spawn(self._discard_checkpoints(job.id, state, without_processes))
            case TerminateProcesses():
                if record is not None:
                    record.terminate(self.config.kill_grace_seconds + KILL_BACKSTOP_SECONDS)
            case ReleaseDevices():
                self.devices.forget(job.id)
                if record is not None:
                    record.close()
                    del self.records[job.id]
            case Reschedule():
                self.request_schedule()
            case RescheduleAfter(seconds=seconds):
                self._later(seconds, self.request_schedule)
            case Note(reason=reason):
                log.info("job %d: %s", job.id, reason)
                try:
                    self.store.add_note(job.id, state, reason, self.clock())
                except StoreUnwritable as error:
                    if not happened:
                        raise  # a request is refused whole
                    # what happened goes on: a lost note must not stop the actions after it
                    log.warning("job %d: note not recorded (%s): %s", job.id, error.message, reason)
            case LaunchProcesses():
                current = self.get_job(job.id)  # with the devices just granted
                self._report(job.id, work.launch(current, self.processes, self.devices), LaunchFailed)
            case RestoreProcesses():
                current = self.get_job(job.id)
                self._report(
                    job.id,
                    work.restore(current, self.processes, self.checkpoints, self.devices),
                    RestoreFailed,
                )
            case WatchProcesses(pid=pid, start_ticks=ticks):
                assert record is not None
                self.store.set_process(job.id, pid, ticks)
                log.info("job %d: supervisor pid %d", job.id, pid)
                record.watch = self.processes.watch(pid, lambda: self._processes_ended(job.id))
            case ArmPeriodicCheckpoint(after=after):
                assert record is not None
                loop = asyncio.get_running_loop()
                record.rearm_periodic(loop.call_later(after, self._periodic_due, job.id))
            case TakeCheckpoint():
                assert record is not None
                outcome: Future[CheckpointTaken] = asyncio.get_running_loop().create_future()
                outcome.add_done_callback(lambda done: done.cancelled() or done.exception())
                record.checkpoint_outcome = outcome
                self.spawn(self._checkpoint(job, action, outcome))
            case Replay(stimulus=stimulus):
                self.apply(job.id, stimulus)
            case _:
                raise TypeError(f"unknown action {action!r}")

    async def _discard_checkpoints(
        self, job_id: int, state: JobState, without_processes: bool = False
    ) -> None:
        """Remove an ended job's checkpoints (off the event loop: they can take gigabytes), saying so;
        `without_processes`: the /dev/shm files they carried too (see DiscardCheckpoints)."""
        freed = await asyncio.to_thread(self.checkpoints.discard, job_id, without_processes)
        if freed:
            reason = (
                f"its checkpoints were removed ({human_bytes(freed)}): a job that has ended never resumes"
            )
            self.store.add_note(job_id, state, reason, self.clock())
            self.feed.publish(job_id)

    def _processes_ended(self, job_id: int) -> None:
        """The job's supervisor ended: report how, as its status file says."""
        record = self.records.get(job_id)
        if record is not None and record.watch is not None:
            record.watch.close()
            record.watch = None
        status = self.processes.exit_status(job_id)
        if status is None:
            self.report_event(job_id, ProcessesLost(missing_status_reason(self.processes.paths(job_id))))
        else:
            self.report_event(job_id, replace(status.as_stimulus(), device_lost=self.devices.lost(job_id)))

    def report_event(self, job_id: int, stimulus: Stimulus) -> None:
        """Feed the state machine something that happened to the job (its processes ended, a
        checkpoint or restore came out): when the state database cannot record it now (a full
        disk, a lock held), it is fed again every STORE_RETRY_SECONDS until it can, so that the
        job does not stay in a state its processes have left."""
        before = self.get_job(job_id).state
        try:
            self.apply(job_id, stimulus, happened=True)
        except StoreUnwritable as error:
            if self.get_job(job_id).state is not before:
                return  # recorded; an action after it was not carried out (logged by apply)
            log.warning(
                "job %d: %s not recorded yet (%s); trying again in %.0fs",
                job_id, type(stimulus).__name__, error.message, STORE_RETRY_SECONDS,
            )  # fmt: skip
            self._later(STORE_RETRY_SECONDS, lambda: self.report_event(job_id, stimulus))

    def _periodic_due(self, job_id: int) -> None:
        """The job's periodic checkpoint interval has passed."""
        record = self.records.get(job_id)
        if record is not None:
            record.periodic = None
            self.apply(job_id, PeriodicCheckpointDue())

    # Long work: each task's outcome comes back as a stimulus

    def _report(
        self, job_id: int, outcome: Coroutine[Any, Any, Stimulus], failed: Callable[[str], Stimulus]
    ) -> None:
        """Run long work as a task and feed the stimulus it returns to the state machine.

        Work that breaks unexpectedly still reports, as `failed` with the error, so no job is left
        waiting for an outcome that never comes.
        """

        async def report() -> None:
            try:
                stimulus = await outcome
            except Exception as error:
                log.exception("job %d: internal error", job_id)
                stimulus = failed(f"internal error: {type(error).__name__}: {error}")
            self.report_event(job_id, stimulus)

        self.spawn(report())

    async def _checkpoint(
        self, job: JobRecord, take: TakeCheckpoint, outcome: Future[CheckpointTaken]
    ) -> None:
        """Take the checkpoint, report it to the state machine, then to whoever waits on `outcome`."""
        try:
            hooks = self.move_pause_hooks.get(job.id) if take.for_move else None
            stimulus, result = await work.checkpoint(job, take, self.processes, self.checkpoints, hooks)
            self.report_event(job.id, stimulus)
            if isinstance(result, StateConflict):
                outcome.set_exception(result)
            else:
                outcome.set_result(result)
        finally:
            if not outcome.done():
                outcome.cancel()

    async def launched(self, job_id: int, timeout: float) -> None:
        """Wait (at most `timeout` seconds) until the job's processes are no longer being started."""
        record = self.records.get(job_id)
        if record is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(record.launched.wait(), timeout)

    async def checkpoint_settled(self, job_id: int) -> None:
        """Wait until the checkpoint under way for the job has ended, however it ended."""
        record = self.records.get(job_id)
        if record is not None and record.checkpoint_outcome is not None:
            await asyncio.wait({record.checkpoint_outcome})

    async def checkpoint_outcome(self, job_id: int) -> CheckpointTaken:
        """The result of the checkpoint just started for the job (a caller giving up does not stop it)."""
        record = self.records[job_id]
        assert record.checkpoint_outcome is not None
        return await asyncio.shield(record.checkpoint_outcome)

    # Scheduling

    def request_schedule(self) -> None:
        """Run a scheduling round soon (many requests in one tick make one round)."""
        if not self._schedule_requested:
            self._schedule_requested = True
            asyncio.get_running_loop().call_soon(self._schedule)

    def cluster_view(self) -> ClusterView:
        """The devices, the live jobs with their activities, and the time, as a round sees them."""
        jobs = tuple(JobView.of(job, self.activity(job.id)) for job in self.store.list_jobs())
        devices = tuple(device.index for device in self.inventory.devices)
        reserved = frozenset(self.reserved_devices())
        return ClusterView(devices, jobs, self.clock(), self.checkpoints.available, reserved=reserved)

    def _schedule(self) -> None:
        self._schedule_requested = False
        began = time.perf_counter()
        view = self._with_idle(self.cluster_view())
        elastic = any(job.max_devices and job.state is JobState.RUNNING for job in view.jobs)
        if not view.queued and not elastic:
            return
        if self.holding_queue:
            self.store.set_pending_reasons({job.job_id: self.holding_queue for job in view.queued})
            return
        plan = plan_round(view)
        wanted = {job.job_id: job.devices_wanted for job in view.queued}
        for job_id, devices in plan.starts:
            if len(devices) != wanted[job_id]:
                self.store.set_gpus(job_id, len(devices))
            self.apply(job_id, Started(devices))
        for job_id in plan.preemptions:
            self.apply(job_id, PreemptionWanted(plan.preempted_for))
        for job_id, gpus in plan.resizes:
            self._resize_for_scheduler(job_id, gpus)
        self.store.set_pending_reasons(plan.pending_reasons)
        for job_id in plan.pending_reasons:
            self.feed.publish(job_id)
        seconds = time.perf_counter() - began
        self.feed.report(RoundPlanned(seconds, len(view.queued), len(plan.starts), len(plan.preemptions)))

    def _with_idle(self, view: ClusterView) -> ClusterView:
        """The view with since when devices have been idle with nothing queued; while an elastic
        job could grow into them, a round is due once it may."""
        grow_after = self.config.elastic_grow_seconds
        if view.queued or not view.free_devices:
            self._idle_since = None
            return view
        if self._idle_since is None:
            self._idle_since = view.now
        left = self._idle_since + grow_after - view.now
        growable = view.can_preempt and any(
            job.state is JobState.RUNNING and len(job.devices) < job.max_devices for job in view.jobs
        )
        if growable and not self._grow_round_due:
            self._grow_round_due = True
            self._later(max(left, 0.0) + GROW_ROUND_MARGIN_SECONDS, self._grow_round)
        return replace(view, idle_since=self._idle_since, grow_after=grow_after)

    def _grow_round(self) -> None:
        """The round due once devices have been idle long enough for elastic jobs to grow."""
        self._grow_round_due = False
        self.request_schedule()

    def _resize_for_scheduler(self, job_id: int, gpus: int) -> None:
        """Start moving a running elastic job to `gpus` devices (nothing if it cannot be now)."""
        previous = self.get_job(job_id).spec.gpus
        try:
            decision = self.apply(job_id, ResizeRequested("the scheduler", gpus))
        except (InvalidTransition, StillLaunching):
            return
        if any(isinstance(action, TakeCheckpoint) for action in decision.actions):
            self.spawn(self._logged_resize(job_id, gpus, previous))

    async def _logged_resize(self, job_id: int, gpus: int, previous: int) -> None:
        """A scheduler's resize to its end; a failed one leaves the job running as it was."""
        try:
            await self.follow_resize(job_id, gpus, previous)
        except Exception as error:
            log.warning("job %d: resize to %d devices failed: %s", job_id, gpus, error)

    async def follow_resize(self, job_id: int, gpus: int, previous: int) -> CheckpointTaken:
        """Store the job's new size while its stopping checkpoint is taken; put `previous` back
        if the checkpoint fails (the job then runs on as it was)."""
        self.store.set_gpus(job_id, gpus)
        try:
            return await self.checkpoint_outcome(job_id)
        except BaseException:
            self.store.set_gpus(job_id, previous)
            raise
