"""The pure job state machine: no I/O, microseconds per test."""

from __future__ import annotations

import signal

import pytest

from singularityd.core.actions import (
    ArmPeriodicCheckpoint,
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
from singularityd.core.decisions import (
    PREEMPTION_BACKOFF_SECONDS,
    Activity,
    CheckpointUnderway,
    Decision,
    JobFacts,
    StillLaunching,
    decide,
)
from singularityd.core.states import (
    ALLOWED_TRANSITIONS,
    InvalidTransition,
    JobState,
    check_transition,
    was_suspended_when_set_aside,
)
from singularityd.core.stimuli import (
    CancelRequested,
    Checkpointed,
    CheckpointFailed,
    CheckpointRequested,
    Exited,
    LaunchFailed,
    MoveAbandoned,
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
)


def facts(state: JobState, cancel: bool = False) -> JobFacts:
    return JobFacts(job_id=7, state=state, cancel_requested=cancel)


def running(
    activity: Activity = Activity(),
    *,
    checkpoint_interval: float = 0.0,
    cancel_requested: bool = False,
    checkpoints_available: bool = True,
) -> JobFacts:
    """A RUNNING job (its processes run, with checkpoints available unless said otherwise)."""
    return JobFacts(
        1,
        JobState.RUNNING,
        cancel_requested,
        checkpoints_available=checkpoints_available,
        checkpoint_interval=checkpoint_interval,
        activity=activity,
    )


def test_start_moves_pending_to_running_with_devices_in_reason() -> None:
    decision = decide(facts(JobState.PENDING), Started((0, 2)), now=1.0)
    assert decision.transition is not None
    assert decision.transition.to_state is JobState.RUNNING
    assert decision.transition.reason == "started on devices 0,2"
    assert decision.transition.at == 1.0
    assert decision.actions == (LaunchProcesses(),)
    assert decision.activity == Activity(launching=True)


def test_a_job_with_a_checkpoint_is_restored_not_launched() -> None:
    restart = decide(JobFacts(1, JobState.PREEMPTED, has_checkpoint=True), Started((2,)), 0)
    assert restart.transition is not None
    assert restart.transition.reason == "resumed from its checkpoint on device 2"
    assert restart.actions == (RestoreProcesses(),)


def test_running_processes_are_watched_and_periodic_checkpoints_armed() -> None:
    launching = running(Activity(launching=True), checkpoint_interval=30.0)
    decision = decide(launching, ProcessesRunning(42, 1000), 0)
    assert decision.transition is None
    assert decision.actions == (WatchProcesses(42, 1000), ArmPeriodicCheckpoint(30.0), Reschedule())
    assert decision.activity == Activity()
    no_interval = decide(running(Activity(launching=True)), ProcessesRunning(42, 1000), 0)
    assert no_interval.actions == (WatchProcesses(42, 1000), Reschedule())


def test_a_cancel_that_arrived_while_launching_is_carried_out_once_running() -> None:
    launching = running(Activity(launching=True), cancel_requested=True)
    decision = decide(launching, ProcessesRunning(42, 1000), 0)
    assert decision.actions == (WatchProcesses(42, 1000), TerminateProcesses(), Reschedule())


def test_a_restore_notes_skipped_checkpoints_and_stops_a_job_its_proxies_refused() -> None:
    restored = Restored(42, 1000, seq=3, skipped=((4, "fails its sha256 check"),))
    decision = decide(running(Activity(launching=True)), restored, 0)
    assert decision.actions == (
        Note("checkpoint 4 not used: fails its sha256 check"),
        Note("restored from checkpoint 3"),
        WatchProcesses(42, 1000),
        Reschedule(),
    )
    broken = Restored(42, 1000, seq=3, problem="the device proxies did not resume the job: gone")
    stopped = decide(running(Activity(launching=True)), broken, 0)
    assert stopped.actions[-2:] == (Note(broken.problem), TerminateProcesses())


@pytest.mark.parametrize(
    ("code", "sig", "error", "state", "reason"),
    [
        (0, None, "", JobState.COMPLETED, "exited with code 0"),
        (3, None, "", JobState.FAILED, "exited with code 3"),
        (None, signal.SIGKILL, "", JobState.FAILED, "killed by SIGKILL"),
        (127, None, "command not found: nope", JobState.FAILED, "command not found: nope"),
    ],
)
def test_exit_outcomes(code: int | None, sig: int | None, error: str, state: JobState, reason: str) -> None:
    decision = decide(facts(JobState.RUNNING), Exited(code, sig, error), now=2.0)
    assert decision.transition is not None
    assert decision.transition.to_state is state
    assert decision.transition.reason == reason
    assert ReleaseDevices() in decision.actions and Reschedule() in decision.actions


LOST = "its device proxy (device 0) was killed by SIGKILL"


@pytest.mark.parametrize(
    ("code", "sig", "state", "reason"),
    [
        (1, None, JobState.FAILED, f"{LOST}, and the program exited with code 1"),
        (None, signal.SIGSEGV, JobState.FAILED, f"{LOST}, and the program was killed by SIGSEGV"),
        (0, None, JobState.COMPLETED, "exited with code 0"),
    ],
)
def test_a_failure_after_a_device_proxy_ended_says_so_first(
    code: int | None, sig: int | None, state: JobState, reason: str
) -> None:
    """A job whose proxy server was killed failed with only "exited with code 1"."""
    decision = decide(facts(JobState.RUNNING), Exited(code, sig, device_lost=LOST), now=2.0)
    assert decision.transition is not None
    assert (decision.transition.to_state, decision.transition.reason) == (state, reason)


def test_exit_after_cancel_request_is_cancelled() -> None:
    decision = decide(facts(JobState.RUNNING, cancel=True), Exited(None, signal.SIGTERM), now=0)
    assert decision.transition is not None
    assert decision.transition.to_state is JobState.CANCELLED
    assert decision.transition.reason == "cancelled (killed by SIGTERM)"


def test_cancel_of_queued_job_is_immediate() -> None:
    decision = decide(facts(JobState.PENDING), CancelRequested("alice"), now=0)
    assert decision.transition is not None
    assert decision.transition.to_state is JobState.CANCELLED
    assert decision.transition.reason == "cancelled by alice"


def test_cancel_of_running_job_signals_and_waits_for_exit() -> None:
    decision = decide(facts(JobState.RUNNING), CancelRequested("alice"), now=0)
    assert decision.transition is None
    assert decision.actions == (MarkCancelRequested(), TerminateProcesses())
    again = decide(facts(JobState.RUNNING, cancel=True), CancelRequested("alice"), now=0)
    assert again.actions == (TerminateProcesses(),)


@pytest.mark.parametrize("state", [JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED])
def test_ended_jobs_cannot_change(state: JobState) -> None:
    assert not ALLOWED_TRANSITIONS[state]
    with pytest.raises(InvalidTransition, match="already"):
        decide(facts(state), CancelRequested("root"), now=0)
    with pytest.raises(InvalidTransition):
        decide(facts(state), Started((0,)), now=0)


@pytest.mark.parametrize(
    ("job", "stimulus", "ends", "without_processes"),
    [
        (facts(JobState.RUNNING), Exited(0, None), True, False),
        (facts(JobState.RUNNING), Exited(3, None), True, False),
        (facts(JobState.RUNNING, cancel=True), Exited(None, signal.SIGTERM), True, False),
        (facts(JobState.PREEMPTED), CancelRequested("alice"), True, True),
        (facts(JobState.SUSPENDED), CancelRequested("alice"), True, True),
        (JobFacts(7, JobState.RUNNING, has_checkpoint=True), ProcessesLost("gone"), False, False),
        (JobFacts(7, JobState.RUNNING, max_restarts=1), Exited(3, None), False, False),
        (facts(JobState.PENDING), Started((0,)), False, False),
    ],
)
def test_a_job_that_ends_for_good_has_its_checkpoints_discarded(
    job: JobFacts,
    stimulus: CancelRequested | Exited | ProcessesLost | Started,
    ends: bool,
    without_processes: bool,
) -> None:
    """Completed, failed or cancelled, from any state: nothing can resume from its checkpoints;
    one that ends with no processes here to end (queued, held) loses its /dev/shm files too."""
    decision = decide(job, stimulus, now=0)
    assert decision.transition is not None
    assert decision.transition.to_state.is_terminal is ends
    discards = [a for a in decision.actions if isinstance(a, DiscardCheckpoints)]
    assert discards == ([DiscardCheckpoints(without_processes)] if ends else [])


def test_lost_and_requeued_and_launch_failure() -> None:
    lost = decide(facts(JobState.RUNNING), ProcessesLost("gone"), now=0)
    assert lost.transition is not None and lost.transition.to_state is JobState.FAILED
    lost_cancel = decide(facts(JobState.RUNNING, cancel=True), ProcessesLost("gone"), now=0)
    assert lost_cancel.transition is not None and lost_cancel.transition.to_state is JobState.CANCELLED
    requeued = decide(facts(JobState.RUNNING), Requeued("again"), now=0)
    assert requeued.transition is not None and requeued.transition.to_state is JobState.PENDING
    failed = decide(facts(JobState.RUNNING), LaunchFailed("no such user"), now=0)
    assert failed.transition is not None and failed.transition.reason == "launch failed: no such user"


def test_every_transition_needs_a_reason() -> None:
    with pytest.raises(ValueError, match="reason"):
        check_transition(1, JobState.PENDING, JobState.RUNNING, "", 0)


# Preempt, suspend, resume and checkpoint requests


@pytest.mark.parametrize(
    ("hold", "note", "reason"),
    [
        (False, "preempt requested by alice: checkpointing", "preempted by alice"),
        (True, "suspend requested by alice: checkpointing", "suspended by alice"),
    ],
)
def test_preempt_and_suspend_take_a_stopping_checkpoint(hold: bool, note: str, reason: str) -> None:
    decision = decide(running(), PreemptRequested("alice", hold=hold), 0)
    take = TakeCheckpoint(stop=True, hold=hold, reason=reason)
    assert decision.transition is None
    assert decision.actions == (Note(note), take)
    assert decision.activity == Activity(checkpoint=take)


def test_a_resize_takes_a_stopping_checkpoint_and_is_refused_while_one_is_under_way() -> None:
    """A resize stops the job through a checkpoint (the new size is in the store); not twice at once."""
    decision = decide(running(), ResizeRequested("alice", 2), 0)
    take = TakeCheckpoint(stop=True, reason="resized to 2 devices by alice", gpus=2)
    assert decision.actions == (Note("resize to 2 devices requested by alice: checkpointing"), take)
    with pytest.raises(CheckpointUnderway, match="already being checkpointed"):
        decide(running(Activity(checkpoint=take)), ResizeRequested("alice", 1), 0)


def test_checkpoint_request_takes_one_in_place() -> None:
    decision = decide(running(), CheckpointRequested("alice"), 0)
    take = TakeCheckpoint(stop=False, reason="checkpoint by alice")
    assert decision.actions == (Note("checkpoint requested by alice"), take)


@pytest.mark.parametrize(
    ("hold", "target", "ending"),
    [(False, JobState.PREEMPTED, "; queued to resume"), (True, JobState.SUSPENDED, "; held until resumed")],
)
def test_a_stopping_checkpoint_that_completes_frees_the_devices(
    hold: bool, target: JobState, ending: str
) -> None:
    take = TakeCheckpoint(stop=True, hold=hold, reason="preempted by alice")
    decision = decide(running(Activity(checkpoint=take)), Checkpointed("checkpoint 2 (10M)"), 0)
    assert decision.transition is not None and decision.transition.to_state is target
    assert decision.transition.reason == f"preempted by alice: checkpoint 2 (10M){ending}"
    assert decision.actions == (ReleaseDevices(), Reschedule())
    assert decision.activity == Activity()


@pytest.mark.parametrize("hold", [False, True])
def test_a_stopping_checkpoint_that_completes_after_a_cancel_ends_the_job_cancelled(hold: bool) -> None:
    take = TakeCheckpoint(stop=True, hold=hold, reason="preempted by alice")
    job = running(Activity(checkpoint=take), cancel_requested=True)
    decision = decide(job, Checkpointed("checkpoint 2 (10M)"), 0)
    assert decision.transition is not None and decision.transition.to_state is JobState.CANCELLED
    assert "cancelled (asked while the checkpoint ran)" in decision.transition.reason
    assert decision.actions == (ReleaseDevices(), Reschedule(), DiscardCheckpoints(without_processes=True))


def test_an_in_place_checkpoint_that_completes_is_noted() -> None:
    take = TakeCheckpoint(stop=False, reason="checkpoint by alice")
    decision = decide(running(Activity(checkpoint=take)), Checkpointed("checkpoint 4 (1M)"), 0)
    assert decision.transition is None
    assert decision.actions == (Note("checkpoint by alice: checkpoint 4 (1M)"), Reschedule())
    assert decision.activity == Activity()


def test_a_failed_checkpoint_is_noted_and_the_job_keeps_running() -> None:
    take = TakeCheckpoint(stop=True, reason="preempted by alice")
    decision = decide(running(Activity(checkpoint=take)), CheckpointFailed("No space left on device"), 0)
    assert decision.transition is None
    assert decision.actions == (
        Note("checkpoint failed, the job keeps running: No space left on device"),
        Reschedule(),
    )
    assert decision.activity == Activity()


@pytest.mark.parametrize(
    ("job", "request_", "message"),
    [
        (
            JobFacts(1, JobState.PENDING),
            PreemptRequested("a"),
            "is PENDING; only a RUNNING job can be preempted",
        ),
        (
            running(Activity(checkpoint=TakeCheckpoint(False))),
            CheckpointRequested("a"),
            "already being checkpointed",
        ),
        (running(checkpoints_available=False), PreemptRequested("a"), "checkpoints are unavailable"),
        (running(cancel_requested=True), PreemptRequested("a"), "is being cancelled"),
        (
            JobFacts(1, JobState.PREEMPTED, has_checkpoint=True),
            ResumeRequested("a"),
            "only a SUSPENDED job can be resumed",
        ),
        (
            JobFacts(1, JobState.SUSPENDED, has_checkpoint=True),
            PreemptRequested("a", hold=True),
            "is SUSPENDED; only a RUNNING or queued job can be suspended",
        ),
    ],
    ids=["queued", "checkpointing", "no-criu", "cancelling", "resume-not-suspended", "suspend-suspended"],
)
def test_requests_the_state_does_not_allow_are_refused(
    job: JobFacts, request_: PreemptRequested | CheckpointRequested | ResumeRequested, message: str
) -> None:
    with pytest.raises(InvalidTransition, match=message):
        decide(job, request_, 0)


@pytest.mark.parametrize("request_", [PreemptRequested("a"), CheckpointRequested("a")])
def test_requests_on_a_launching_job_are_told_to_wait(
    request_: PreemptRequested | CheckpointRequested,
) -> None:
    with pytest.raises(StillLaunching, match="still starting"):
        decide(running(Activity(launching=True)), request_, 0)


@pytest.mark.parametrize(
    ("has_checkpoint", "target"), [(True, JobState.PREEMPTED), (False, JobState.PENDING)]
)
def test_resume_queues_a_suspended_job(has_checkpoint: bool, target: JobState) -> None:
    decision = decide(JobFacts(1, JobState.SUSPENDED, has_checkpoint=has_checkpoint), ResumeRequested("a"), 0)
    assert decision.transition is not None and decision.transition.to_state is target
    assert decision.actions == (Reschedule(),)


def test_suspending_a_queued_job_holds_it_without_a_checkpoint() -> None:
    decision = decide(JobFacts(1, JobState.PENDING), PreemptRequested("alice", hold=True), 0)
    assert decision.transition is not None and decision.transition.to_state is JobState.SUSPENDED
    assert decision.actions == ()


def test_lost_processes_of_a_checkpointed_job_queue_it_to_resume() -> None:
    lost = decide(JobFacts(1, JobState.RUNNING, has_checkpoint=True), ProcessesLost("gone"), 0)
    assert lost.transition is not None and lost.transition.to_state is JobState.PREEMPTED


def test_a_job_without_a_good_checkpoint_fails_when_its_restore_fails() -> None:
    broken = decide(running(Activity(launching=True)), RestoreFailed("all corrupt"), 0)
    assert broken.transition is not None and broken.transition.reason == "cannot resume: all corrupt"
    assert broken.actions == (ReleaseDevices(), Reschedule(), DiscardCheckpoints(without_processes=True))


def test_a_good_checkpoint_that_cannot_be_restored_now_is_held_with_the_job() -> None:
    """CRIU refusing a verified checkpoint (an address the job had bound now taken) holds the job
    with its checkpoints, to be resumed when the cause is gone, rather than failing it for good."""
    held = decide(running(Activity(launching=True)), RestoreFailed("port taken", checkpoint_good=True), 0)
    assert held.transition is not None and held.transition.to_state is JobState.SUSPENDED
    assert held.transition.reason.startswith("cannot resume: port taken; held with its checkpoints")
    assert held.actions == (ReleaseDevices(), Reschedule())
    assert held.activity == Activity()


# An exit during a checkpoint


def test_an_exit_during_a_checkpoint_waits_for_it() -> None:
    take = TakeCheckpoint(stop=False, reason="checkpoint by alice")
    ended = Exited(0, None)
    decision = decide(running(Activity(checkpoint=take)), ended, 0)
    assert decision.transition is None and decision.actions == ()
    assert decision.activity == Activity(checkpoint=take, deferred_exit=ended)


@pytest.mark.parametrize("succeeded", [True, False])
def test_an_exit_held_back_is_replayed_after_an_in_place_checkpoint(succeeded: bool) -> None:
    take = TakeCheckpoint(stop=False, reason="periodic checkpoint", periodic=True)
    ended = Exited(0, None)
    job = running(Activity(checkpoint=take, deferred_exit=ended), checkpoint_interval=5.0)
    outcome = Checkpointed("checkpoint 1 (1M)") if succeeded else CheckpointFailed("frozen")
    decision = decide(job, outcome, 0)
    assert decision.transition is None
    assert decision.actions[-1] == Replay(ended), "the exit comes after the checkpoint's event"
    assert ArmPeriodicCheckpoint(5.0) not in decision.actions, "no next checkpoint for an ended job"
    assert decision.activity == Activity()
    replayed = decide(running(decision.activity), ended, 0)
    assert replayed.transition is not None and replayed.transition.to_state is JobState.COMPLETED


def test_the_exit_a_stopping_checkpoint_causes_is_not_the_jobs_end() -> None:
    take = TakeCheckpoint(stop=True, reason="preempted by alice")
    job = running(Activity(checkpoint=take, deferred_exit=Exited(None, signal.SIGKILL)))
    decision = decide(job, Checkpointed("checkpoint 1 (1M)"), 0)
    assert decision.transition is not None and decision.transition.to_state is JobState.PREEMPTED
    assert not any(isinstance(action, Replay) for action in decision.actions)


@pytest.mark.parametrize("ended", [Exited(None, signal.SIGKILL), ProcessesLost("gone")])
def test_an_exit_of_a_job_that_no_longer_holds_devices_is_ignored(ended: Exited | ProcessesLost) -> None:
    assert decide(JobFacts(1, JobState.PREEMPTED), ended, 0) == Decision()


# Periodic checkpoints


def test_a_periodic_checkpoint_is_taken_when_the_job_is_idle_and_rearmed_after() -> None:
    job = running(checkpoint_interval=5.0)
    due = decide(job, PeriodicCheckpointDue(), 0)
    take = TakeCheckpoint(stop=False, reason="periodic checkpoint", periodic=True)
    assert due.actions == (take,)
    done = decide(
        running(Activity(checkpoint=take), checkpoint_interval=5.0), Checkpointed("checkpoint 1"), 0
    )
    assert done.actions == (
        Note("periodic checkpoint: checkpoint 1"),
        ArmPeriodicCheckpoint(5.0),
        Reschedule(),
    )


def test_a_periodic_checkpoint_due_while_busy_is_put_off() -> None:
    busy = running(Activity(checkpoint=TakeCheckpoint(False)), checkpoint_interval=5.0)
    assert decide(busy, PeriodicCheckpointDue(), 0).actions == (
        Note("skipped the checkpoint due by the interval: another checkpoint of the job is under way"),
        ArmPeriodicCheckpoint(5.0),
    )
    starting = running(Activity(launching=True), checkpoint_interval=5.0)
    assert decide(starting, PeriodicCheckpointDue(), 0).actions == (ArmPeriodicCheckpoint(5.0),)
    assert decide(JobFacts(1, JobState.PREEMPTED), PeriodicCheckpointDue(), 0).actions == ()


def test_checkpoints_slower_than_their_interval_are_reported_and_never_overlap() -> None:
    take = TakeCheckpoint(False, reason="periodic checkpoint", periodic=True)
    job = running(Activity(checkpoint=take), checkpoint_interval=5.0)
    done = decide(job, Checkpointed("checkpoint 1", complete_s=7.5), 0)
    assert done.actions == (
        Note("periodic checkpoint: checkpoint 1"),
        ArmPeriodicCheckpoint(5.0),
        Note(
            "checkpoints take longer to complete (7.5s) than the job's interval (5s): the disk is "
            "slower than the job's state changes; the next one starts 5s after this one completed"
        ),
        Reschedule(),
    )
    quick = decide(job, Checkpointed("checkpoint 1", complete_s=2.0), 0)
    assert not any("longer" in getattr(a, "reason", "") for a in quick.actions)


def test_a_restore_says_how_long_the_job_was_down() -> None:
    job = JobFacts(1, JobState.RUNNING, activity=Activity(launching=True))
    restored = Restored(42, 1000, seq=3, downtime="down 3.10s in all")
    assert Note("restored from checkpoint 3 (down 3.10s in all)") in decide(job, restored, 0).actions


# Scheduler preemption and its back-off


def test_the_scheduler_preempts_an_idle_job() -> None:
    decision = decide(running(), PreemptionWanted(9), 0)
    take = TakeCheckpoint(stop=True, reason="preempted for job 9, which outranks it", for_scheduler=True)
    assert decision.actions[-1] == take
    assert decision.actions[0] == Note(
        "preempt requested by the scheduler (for job 9, which outranks it): checkpointing"
    )


def test_a_failed_scheduler_preemption_backs_off_and_a_later_one_clears_the_back_off() -> None:
    take = TakeCheckpoint(stop=True, reason="preempted for a job, which outranks it", for_scheduler=True)
    failed = decide(running(Activity(checkpoint=take)), CheckpointFailed("io_uring"), now=100.0)
    backoff = 100.0 + PREEMPTION_BACKOFF_SECONDS
    assert failed.activity == Activity(preemption_backoff_until=backoff)
    assert RescheduleAfter(PREEMPTION_BACKOFF_SECONDS) in failed.actions
    assert failed.activity is not None
    assert not failed.activity.preemptible_at(backoff - 1) and failed.activity.preemptible_at(backoff)
    again = decide(running(failed.activity), PreemptionWanted(), now=backoff)
    assert again.activity == Activity(checkpoint=take), "trying again clears the back-off"


def test_a_scheduler_preemption_the_job_cannot_take_backs_off() -> None:
    decision = decide(running(Activity(launching=True)), PreemptionWanted(), now=10.0)
    assert decision.actions == (RescheduleAfter(PREEMPTION_BACKOFF_SECONDS),)
    assert decision.activity == Activity(
        launching=True, preemption_backoff_until=10.0 + PREEMPTION_BACKOFF_SECONDS
    )


# Moves between peers


@pytest.mark.parametrize(
    ("before", "has_checkpoint", "after"),
    [
        (JobState.SUSPENDED, True, JobState.SUSPENDED),
        (JobState.SUSPENDED, False, JobState.SUSPENDED),
        (JobState.PREEMPTED, True, JobState.PREEMPTED),
        (JobState.PENDING, False, JobState.PENDING),
    ],
)
def test_a_job_set_aside_for_a_move_that_stays_is_held_as_it_was(
    before: JobState, has_checkpoint: bool, after: JobState
) -> None:
    """A suspended job set aside for a move and kept (the move failed, or it arrived) stays
    suspended until resumed; queued ones are queued again."""
    set_aside = decide(JobFacts(7, before, has_checkpoint=has_checkpoint), MoveStopRequested("node-b"), 0)
    assert set_aside.transition is not None and set_aside.transition.to_state is JobState.MIGRATING
    held = before is JobState.SUSPENDED
    kept = decide(JobFacts(7, JobState.MIGRATING, has_checkpoint=has_checkpoint), MoveAbandoned("x", held), 1)
    assert kept.transition is not None and kept.transition.to_state is after


def test_a_history_says_whether_the_job_was_suspended_when_last_set_aside() -> None:
    set_aside_suspended = [(None, "PENDING"), ("PENDING", "RUNNING"), ("RUNNING", "SUSPENDED"),
                           ("SUSPENDED", "MIGRATING"), ("MIGRATING", "MIGRATING"),
                           (None, "MIGRATING")]  # fmt: skip
    assert was_suspended_when_set_aside(set_aside_suspended)
    came_back = [*set_aside_suspended, ("MIGRATING", "SUSPENDED"), ("SUSPENDED", "PREEMPTED"),
                 ("PREEMPTED", "RUNNING"), ("RUNNING", "MIGRATING"), ("MOVED", "MIGRATING")]  # fmt: skip
    assert not was_suspended_when_set_aside(came_back)
    assert not was_suspended_when_set_aside([(None, "PENDING")])
