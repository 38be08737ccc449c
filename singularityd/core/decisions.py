"""The job state machine: pure decisions, no I/O.

The daemon feeds a job's facts (its stored state and its in-memory activity) and one stimulus to
`decide`, records the transition it returns, keeps the activity it returns and carries out the
actions in order. Long work (launch, restore, checkpoint) is an action whose outcome comes back
as a stimulus, so this module, not the caller, decides what an outcome means. Keeping it free of
I/O lets every rule be tested in microseconds and replayed by a simulator.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field, replace

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
from singularityd.core.states import InvalidTransition, JobState, Transition, check_transition
from singularityd.core.stimuli import (
    Arrived,
    CancelRequested,
    Checkpointed,
    CheckpointFailed,
    CheckpointRequested,
    Exited,
    LaunchFailed,
    MoveAbandoned,
    MovedAway,
    MoveStopRequested,
    PeriodicCheckpointDue,
    PreemptionWanted,
    PreemptRequested,
    ProcessesLost,
    ProcessesRunning,
    Requeued,
    ResizeRequested,
    Restored,
    RestoreFailed,
    ResumeRequested,
    Started,
    Stimulus,
)


class StillLaunching(InvalidTransition):
    """The job's processes are being started or restored; a request that needs them must wait."""


class CheckpointUnderway(InvalidTransition):
    """A checkpoint of the job is being taken; a request for another one must wait for its end."""


PREEMPTION_BACKOFF_SECONDS = 60.0


@dataclass(frozen=True)
class Activity:
    """What is under way with a job's processes: volatile, kept by the daemon, never stored.

    `launching` from the grant of devices until the processes run or fail to start; `checkpoint`
    while a checkpoint is taken; `deferred_exit` an exit seen during that checkpoint, replayed
    once it is over; `preemption_backoff_until` the time before which the scheduler leaves the
    job alone, after preempting it failed.
    """

    launching: bool = False
    checkpoint: TakeCheckpoint | None = None
    deferred_exit: Exited | ProcessesLost | None = None
    preemption_backoff_until: float | None = None

    @property
    def idle(self) -> bool:
        """Whether the processes run with nothing under way (a checkpoint may start)."""
        return not self.launching and self.checkpoint is None

    def preemptible_at(self, now: float) -> bool:
        """Whether the scheduler may preempt the job now (running, idle, not backing off)."""
        backoff = self.preemption_backoff_until
        return self.idle and (backoff is None or now >= backoff)


@dataclass(frozen=True)
class JobFacts:
    """What the state machine needs to know about a job to decide."""

    job_id: int
    state: JobState
    cancel_requested: bool = False
    has_checkpoint: bool = False
    checkpoints_available: bool = True
    checkpoint_interval: float = 0.0
    activity: Activity = field(default_factory=Activity)
    max_restarts: int = 0
    restarts_used: int = 0
    last_checkpoint: int | None = None
    """The newest complete checkpoint's number, for what a restart says (None: unknown or none)."""


@dataclass(frozen=True)
class Decision:
    """The outcome of one stimulus: a transition to record, the job's activity, actions to take.

    `activity` is None when the stimulus leaves the activity as it was.
    """

    transition: Transition | None = None
    actions: tuple[Action, ...] = field(default_factory=tuple)
    activity: Activity | None = None


def describe_exit(exit_code: int | None, sig: int | None) -> str:
    """A short human description of how processes ended."""
    if sig is not None:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by {name}"
    if exit_code is None:
        return "ended without an exit status"
    return f"exited with code {exit_code}"


def _require_idle_running(job: JobFacts, verb: str) -> None:
    """Refuse (or, while the processes start, defer) a checkpoint the job cannot take now."""
    if job.state is not JobState.RUNNING:
        raise InvalidTransition(f"job {job.job_id} is {job.state}; only a RUNNING job can be {verb}")
    if not job.checkpoints_available:
        raise InvalidTransition(f"job {job.job_id} cannot be {verb}: checkpoints are unavailable here")
    if job.activity.checkpoint is not None:
        raise CheckpointUnderway(f"job {job.job_id} is already being checkpointed")
    if job.cancel_requested:
        raise InvalidTransition(f"job {job.job_id} is being cancelled")
    if job.activity.launching:
        raise StillLaunching(f"job {job.job_id} is still starting")


def _checkpointing(job: JobFacts, take: TakeCheckpoint, *first: Action) -> Decision:
    """Start a checkpoint: remember it as the job's activity and carry it out."""
    activity = replace(job.activity, checkpoint=take)
    if take.for_scheduler:
        activity = replace(activity, preemption_backoff_until=None)
    return Decision(actions=(*first, take), activity=activity)


def _periodic(job: JobFacts) -> tuple[Action, ...]:
    """Arm the next periodic checkpoint, when the job has an interval and checkpoints work."""
    if job.checkpoints_available and job.checkpoint_interval > 0:
        return (ArmPeriodicCheckpoint(job.checkpoint_interval),)
    return ()


def _running(job: JobFacts, pid: int, ticks: int) -> tuple[Action, ...]:
    """What follows once the job's supervisor runs: watch it, arm checkpoints, honour a cancel, and
    a scheduling round, since what the scheduler could not do with a starting job (grow it into
    idle devices, preempt it for a waiting one) it may do now."""
    cancel: tuple[Action, ...] = (TerminateProcesses(),) if job.cancel_requested else ()
    return (WatchProcesses(pid, ticks), *_periodic(job), *cancel, Reschedule())


def _ended(job: JobFacts, stimulus: Exited | ProcessesLost, now: float) -> Decision:
    """The job's processes are gone: record how, free the devices."""
    state = job.state
    if not state.holds_devices:
        return Decision()  # processes of a job that no longer holds devices: already settled
    if job.activity.checkpoint is not None:
        return Decision(activity=replace(job.activity, deferred_exit=stimulus))
    release = (ReleaseDevices(), Reschedule())
    if isinstance(stimulus, ProcessesLost):
        if job.has_checkpoint and not job.cancel_requested:
            reason = f"{stimulus.detail}; queued to resume from its last checkpoint"
            return Decision(check_transition(job.job_id, state, JobState.PREEMPTED, reason, now), release)
        target = JobState.CANCELLED if job.cancel_requested else JobState.FAILED
        return Decision(check_transition(job.job_id, state, target, stimulus.detail, now), release)
    code, sig, error = stimulus.exit_code, stimulus.signal, stimulus.error
    succeeded = code == 0 and sig is None and not error
    how = error or describe_exit(code, sig)
    if stimulus.device_lost and not succeeded:
        ended = how if error or sig is None else f"was {how}"
        how = (
            f"{stimulus.device_lost}; {error}"
            if error
            else f"{stimulus.device_lost}, and the program {ended}"
        )
    if job.cancel_requested:
        target, reason = JobState.CANCELLED, f"cancelled ({how})"
    elif succeeded:
        target, reason = JobState.COMPLETED, how
    elif job.restarts_used < job.max_restarts and state is JobState.RUNNING:
        return _restarted(job, how, now)
    elif 0 < job.max_restarts <= job.restarts_used:
        target, reason = JobState.FAILED, f"{how}; restarts used: {job.restarts_used} of {job.max_restarts}"
    else:
        target, reason = JobState.FAILED, how
    return Decision(check_transition(job.job_id, state, target, reason, now), release)


def _restarted(job: JobFacts, how: str, now: float) -> Decision:
    """The job failed with restarts left: queue it to resume from its newest complete checkpoint,
    or, with none, to start again from its command (torchrun's --max-restarts)."""
    count = f"restart {job.restarts_used + 1} of {job.max_restarts}"
    if job.has_checkpoint:
        which = "its last checkpoint" if job.last_checkpoint is None else f"checkpoint {job.last_checkpoint}"
        target, reason = JobState.PREEMPTED, f"{how}; restoring from {which} ({count})"
    else:
        target, reason = JobState.PENDING, f"{how}; no checkpoint: restarting from the beginning ({count})"
    transition = check_transition(job.job_id, job.state, target, reason, now)
    return Decision(transition, (CountRestart(), ReleaseDevices(), Reschedule()))


def _checkpoint_over(
    job: JobFacts, succeeded: bool, text: str, now: float, complete_s: float = 0.0
) -> Decision:
    """The checkpoint under way ended: record it, then whatever it held back or leads to."""
    take = job.activity.checkpoint
    if take is None:
        raise InvalidTransition(f"job {job.job_id} has no checkpoint under way")
    activity = replace(job.activity, checkpoint=None, deferred_exit=None)
    if succeeded and take.stop:
        if job.cancel_requested:
            reason = f"{text}; cancelled (asked while the checkpoint ran), not resumed"
            transition = check_transition(job.job_id, job.state, JobState.CANCELLED, reason, now)
            return Decision(transition, (ReleaseDevices(), Reschedule()), activity)
        if take.for_move:
            target, reason = JobState.MIGRATING, f"{text}; its checkpoint is on the way"
        elif take.hold:
            target, reason = JobState.SUSPENDED, f"{text}; held until resumed"
        else:
            target, reason = JobState.PREEMPTED, f"{text}; queued to resume"
        transition = check_transition(job.job_id, job.state, target, reason, now)
        return Decision(transition, (ReleaseDevices(), Reschedule()), activity)
    actions: list[Action] = [Note(text)]
    if not succeeded and take.for_scheduler:
        activity = replace(activity, preemption_backoff_until=now + PREEMPTION_BACKOFF_SECONDS)
        actions.append(RescheduleAfter(PREEMPTION_BACKOFF_SECONDS))
    if job.activity.deferred_exit is not None:
        actions.append(Replay(job.activity.deferred_exit))
        return Decision(actions=tuple(actions), activity=activity)
    if take.periodic:
        actions += _periodic(job)
    if succeeded and complete_s > job.checkpoint_interval > 0:
        actions.append(
            Note(
                f"checkpoints take longer to complete ({complete_s:.1f}s) than the job's interval "
                f"({job.checkpoint_interval:g}s): the disk is slower than the job's state changes; "
                f"the next one starts {job.checkpoint_interval:g}s after this one completed"
            )
        )
    actions.append(Reschedule())  # the job may be preempted again
    return Decision(actions=tuple(actions), activity=activity)


def _require_here(job: JobFacts, verb: str) -> None:
    """Refuse a request on a job that a hand-off is moving, or that lives on another node."""
    if job.state is JobState.MIGRATING:
        raise InvalidTransition(f"job {job.job_id} is moving between nodes; it can be {verb} once it has")
    if job.state is JobState.MOVED:
        raise InvalidTransition(f"job {job.job_id} lives on another node now; ask that node")


def _moving(
    job: JobFacts, stimulus: MoveStopRequested | Arrived | MoveAbandoned | MovedAway, now: float
) -> Decision:
    """A hand-off between peer daemons acting on the job (see singularityd.federation.handoff)."""
    state = job.state
    match stimulus:
        case MoveStopRequested(peer=peer):
            if state is JobState.MIGRATING:
                return Decision()
            if state in (JobState.PENDING, JobState.PREEMPTED, JobState.SUSPENDED):
                reason = f"set aside to move to {peer}"
                return Decision(check_transition(job.job_id, state, JobState.MIGRATING, reason, now))
            if state is not JobState.RUNNING:
                raise InvalidTransition(f"job {job.job_id} is {state}; it cannot move")
            _require_idle_running(job, "moved")
            take = TakeCheckpoint(True, reason=f"stopped to move to {peer}", for_move=True)
            return _checkpointing(job, take, Note(f"move to {peer}: checkpointing and stopping"))
        case Arrived(pid=pid, start_ticks=ticks, reason=reason):
            if state is not JobState.MIGRATING:
                return Decision()
            transition = check_transition(job.job_id, state, JobState.RUNNING, reason, now)
            return Decision(transition, _running(job, pid, ticks), Activity())
        case MoveAbandoned(reason=reason, held=held):
            if state is not JobState.MIGRATING:
                return Decision()
            if held:
                target = JobState.SUSPENDED
            else:
                target = JobState.PREEMPTED if job.has_checkpoint else JobState.PENDING
            return Decision(
                check_transition(job.job_id, state, target, reason, now),
                (ReleaseDevices(), Reschedule()),
                Activity(),
            )
        case MovedAway(reason=reason):
            if state is JobState.MOVED:
                return Decision()
            return Decision(
                check_transition(job.job_id, state, JobState.MOVED, reason, now),
                (ReleaseDevices(), Reschedule()),
                Activity(),
            )
    raise TypeError(f"unknown stimulus {stimulus!r}")


def decide(job: JobFacts, stimulus: Stimulus, now: float) -> Decision:
    """Decide what a stimulus does to a job: the transition to record and the actions to take.

    A job that ends for good (completed, failed, cancelled) can never resume, so its checkpoints
    are removed then: they hold its processes' memory and would fill the disk."""
    decision = _decide(job, stimulus, now)
    if decision.transition is not None and decision.transition.to_state.is_terminal:
        discard = DiscardCheckpoints(without_processes=_ends_without_processes(job, stimulus))
        return replace(decision, actions=(*decision.actions, discard))
    return decision


def _ends_without_processes(job: JobFacts, stimulus: Stimulus) -> bool:
    """Whether a job that ends on this stimulus has no processes here to end: it was queued or
    held, its restore failed, or the checkpoint that stopped them completed."""
    if job.state in (JobState.PENDING, JobState.PREEMPTED, JobState.SUSPENDED):
        return True
    stopped = job.activity.checkpoint is not None and job.activity.checkpoint.stop
    return isinstance(stimulus, RestoreFailed) or (isinstance(stimulus, Checkpointed) and stopped)


def _decide(job: JobFacts, stimulus: Stimulus, now: float) -> Decision:
    """`decide` before an ending's checkpoints are discarded."""
    state = job.state
    match stimulus:
        case Started(devices=devices):
            listed = ",".join(str(d) for d in devices)
            where = f"device{'s' if len(devices) != 1 else ''} {listed}"
            start: Action = RestoreProcesses() if job.has_checkpoint else LaunchProcesses()
            if job.has_checkpoint:
                reason = f"resumed from its checkpoint on {where}"
            else:
                reason = f"started on {where}"
            transition = check_transition(job.job_id, state, JobState.RUNNING, reason, now)
            return Decision(transition, (start,), Activity(launching=True))
        case ProcessesRunning(pid=pid, start_ticks=ticks):
            if not state.holds_devices:
                raise InvalidTransition(f"job {job.job_id} is {state}; its processes cannot run")
            started = replace(job.activity, launching=False)
            return Decision(actions=_running(job, pid, ticks), activity=started)
        case Restored(pid=pid, start_ticks=ticks, seq=seq, skipped=skipped, problem=problem, downtime=down):
            if not state.holds_devices:
                raise InvalidTransition(f"job {job.job_id} is {state}; its processes cannot run")
            notes = [Note(f"checkpoint {s} not used: {why}") for s, why in skipped]
            notes.append(Note(f"restored from checkpoint {seq}" + (f" ({down})" if down else "")))
            actions = (*notes, *_running(job, pid, ticks))
            if problem and not job.cancel_requested:
                actions += (Note(problem), TerminateProcesses())
            elif problem:
                actions += (Note(problem),)
            return Decision(actions=actions, activity=replace(job.activity, launching=False))
        case LaunchFailed(error=error):
            return Decision(
                check_transition(job.job_id, state, JobState.FAILED, f"launch failed: {error}", now),
                (ReleaseDevices(), Reschedule()),
                Activity(),
            )
        case RestoreFailed(error=error, checkpoint_good=True):
            held = f"cannot resume: {error}; held with its checkpoints (`sing resume` tries again)"
            return Decision(
                check_transition(job.job_id, state, JobState.SUSPENDED, held, now),
                (ReleaseDevices(), Reschedule()),
                Activity(),
            )
        case RestoreFailed(error=error):
            return Decision(
                check_transition(job.job_id, state, JobState.FAILED, f"cannot resume: {error}", now),
                (ReleaseDevices(), Reschedule()),
                Activity(),
            )
        case Exited() | ProcessesLost():
            return _ended(job, stimulus, now)
        case CancelRequested(by=by):
            if state.is_terminal:
                raise InvalidTransition(f"job {job.job_id} is already {state}")
            _require_here(job, "cancelled")
            if state.holds_devices:
                if job.cancel_requested:
                    return Decision(actions=(TerminateProcesses(),))
                return Decision(actions=(MarkCancelRequested(), TerminateProcesses()))
            return Decision(
                check_transition(job.job_id, state, JobState.CANCELLED, f"cancelled by {by}", now),
                (ReleaseDevices(), Reschedule()),
            )
        case PreemptRequested(by=by, hold=hold):
            if hold and state in (JobState.PENDING, JobState.PREEMPTED):
                return Decision(check_transition(job.job_id, state, JobState.SUSPENDED, f"held by {by}", now))
            if hold and state is not JobState.RUNNING:
                raise InvalidTransition(
                    f"job {job.job_id} is {state}; only a RUNNING or queued job can be suspended"
                )
            _require_idle_running(job, "suspended" if hold else "preempted")
            verb = "suspend" if hold else "preempt"
            take = TakeCheckpoint(True, hold, f"{'suspended' if hold else 'preempted'} by {by}")
            return _checkpointing(job, take, Note(f"{verb} requested by {by}: checkpointing"))
        case ResizeRequested(by=by, gpus=gpus):
            _require_idle_running(job, "resized")
            where = f"{gpus} device{'s' if gpus != 1 else ''}"
            take = TakeCheckpoint(True, reason=f"resized to {where} by {by}", gpus=gpus)
            return _checkpointing(job, take, Note(f"resize to {where} requested by {by}: checkpointing"))
        case PreemptionWanted(for_job=for_job):
            try:
                _require_idle_running(job, "preempted")
            except InvalidTransition:
                backoff = replace(job.activity, preemption_backoff_until=now + PREEMPTION_BACKOFF_SECONDS)
                return Decision(actions=(RescheduleAfter(PREEMPTION_BACKOFF_SECONDS),), activity=backoff)
            which = f"job {for_job}" if for_job else "a job"
            take = TakeCheckpoint(
                True, reason=f"preempted for {which}, which outranks it", for_scheduler=True
            )
            by = f"the scheduler (for {which}, which outranks it)"
            return _checkpointing(job, take, Note(f"preempt requested by {by}: checkpointing"))
        case ResumeRequested(by=by):
            if state is not JobState.SUSPENDED:
                raise InvalidTransition(f"job {job.job_id} is {state}; only a SUSPENDED job can be resumed")
            target = JobState.PREEMPTED if job.has_checkpoint else JobState.PENDING
            return Decision(
                check_transition(job.job_id, state, target, f"resumed by {by}; queued", now), (Reschedule(),)
            )
        case CheckpointRequested(by=by):
            _require_idle_running(job, "checkpointed")
            take = TakeCheckpoint(False, reason=f"checkpoint by {by}")
            return _checkpointing(job, take, Note(f"checkpoint requested by {by}"))
        case PeriodicCheckpointDue():
            if state is not JobState.RUNNING:
                return Decision()
            if job.activity.checkpoint is not None:
                busy = Note(
                    "skipped the checkpoint due by the interval: another checkpoint of the job is under way"
                )
                return Decision(actions=(busy, *_periodic(job)))
            if not job.activity.idle or job.cancel_requested:
                return Decision(actions=_periodic(job))
            return _checkpointing(job, TakeCheckpoint(False, reason="periodic checkpoint", periodic=True))
        case Checkpointed(summary=summary, complete_s=complete_s):
            under_way = job.activity.checkpoint
            reason = under_way.reason if under_way else "checkpoint"
            return _checkpoint_over(job, True, f"{reason}: {summary}", now, complete_s)
        case CheckpointFailed(job_ended=True):
            under_way = job.activity.checkpoint
            reason = f" ({under_way.reason})" if under_way else ""
            return _checkpoint_over(
                job, False, f"the job ended during its checkpoint{reason}: none taken", now
            )
        case CheckpointFailed(error=error):
            return _checkpoint_over(job, False, f"checkpoint failed, the job keeps running: {error}", now)
        case MoveStopRequested() | Arrived() | MoveAbandoned() | MovedAway():
            return _moving(job, stimulus, now)
        case Requeued(detail=detail):
            return Decision(
                check_transition(job.job_id, state, JobState.PENDING, detail, now),
                (ReleaseDevices(), Reschedule()),
                Activity(),
            )
    raise TypeError(f"unknown stimulus {stimulus!r}")
