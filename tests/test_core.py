"""The pure job state machine and scheduling policy: no I/O, microseconds per test."""

from __future__ import annotations

import signal

import pytest

from singularityd.core.jobs import (
    ALLOWED_TRANSITIONS,
    CancelRequested,
    Exited,
    InvalidTransition,
    JobFacts,
    JobState,
    LaunchFailed,
    MarkCancelRequested,
    ProcessesLost,
    ReleaseDevices,
    Requeued,
    Reschedule,
    Started,
    TerminateProcesses,
    check_transition,
    decide,
    shell_exit_status,
)
from singularityd.core.policy import QueuedJob, RunningJob, plan_starts


def facts(state: JobState, cancel: bool = False) -> JobFacts:
    return JobFacts(job_id=7, state=state, cancel_requested=cancel)


def test_start_moves_pending_to_running_with_devices_in_reason() -> None:
    decision = decide(facts(JobState.PENDING), Started((0, 2)), now=1.0)
    assert decision.transition is not None
    assert decision.transition.to_state is JobState.RUNNING
    assert decision.transition.reason == "started on devices 0,2"
    assert decision.transition.at == 1.0


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


def test_shell_exit_status() -> None:
    assert shell_exit_status(3, None) == 3
    assert shell_exit_status(None, 9) == 137


def queued(job_id: int, wanted: int, priority: int = 0) -> QueuedJob:
    return QueuedJob(job_id=job_id, priority=priority, submit_seq=job_id, devices_wanted=wanted)


def test_policy_priority_then_fifo() -> None:
    plan = plan_starts(
        [queued(1, 1), queued(2, 1, priority=5), queued(3, 1)], free_devices=[0, 1], total_devices=2
    )
    assert plan.starts == ((2, (0,)), (1, (1,)))
    assert plan.pending_reasons == {3: "Resources: needs 1 device, 0 free"}


def test_policy_gang_allocation_and_strict_queue() -> None:
    plan = plan_starts([queued(1, 3), queued(2, 1)], free_devices=[1, 3], total_devices=4)
    assert plan.starts == ()
    assert plan.pending_reasons == {
        1: "Resources: needs 3 devices, 2 free",
        2: "Priority: queued behind job 1",
    }
    plan = plan_starts([queued(1, 2), queued(2, 2)], free_devices=[0, 1, 2, 3], total_devices=4)
    assert plan.starts == ((1, (0, 1)), (2, (2, 3)))


def test_policy_never_overcommits_and_names_unsatisfiable_jobs() -> None:
    plan = plan_starts([queued(1, 5), queued(2, 1)], free_devices=[0], total_devices=4)
    assert plan.starts == ((2, (0,)),)
    assert plan.pending_reasons[1] == "Unsatisfiable: needs 5 devices, the machine has 4"
    granted = [
        d
        for _, devices in plan_starts([queued(i, 1) for i in range(10)], [0, 1, 2], 3).starts
        for d in devices
    ]
    assert sorted(granted) == [0, 1, 2]


def running(
    job_id: int, priority: int, devices: tuple[int, ...], started: float, stopping: bool = False
) -> RunningJob:
    return RunningJob(
        job_id=job_id, priority=priority, started_seq=started, devices=devices, stopping=stopping
    )


def test_policy_preempts_the_fewest_lowest_priority_jobs() -> None:
    busy = [running(1, 0, (0,), 1.0), running(2, 0, (1,), 2.0), running(3, 5, (2, 3), 3.0)]
    plan = plan_starts([queued(9, 1, priority=3)], [], 4, busy, can_preempt=True)
    assert plan.starts == () and plan.preemptions == (2,), "newest of the lowest priority goes first"
    assert plan.pending_reasons[9] == "Preempting: checkpointing lower-priority job(s) 2"
    plan = plan_starts([queued(9, 2, priority=3)], [], 4, busy, can_preempt=True)
    assert plan.preemptions == (2, 1)


def test_policy_never_preempts_equal_or_higher_priority_or_without_checkpoints() -> None:
    busy = [running(1, 3, (0, 1), 1.0)]
    plan = plan_starts([queued(9, 1, priority=3)], [], 2, busy, can_preempt=True)
    assert plan.preemptions == () and plan.pending_reasons[9] == "Resources: needs 1 device, 0 free"
    lower = [running(1, 0, (0, 1), 1.0)]
    assert plan_starts([queued(9, 1, priority=3)], [], 2, lower, can_preempt=False).preemptions == ()


def test_policy_waits_for_jobs_already_stopping() -> None:
    busy = [running(1, 0, (0,), 1.0, stopping=True), running(2, 0, (1,), 2.0)]
    plan = plan_starts([queued(9, 1, priority=3), queued(10, 1, priority=3)], [], 2, busy, can_preempt=True)
    assert plan.preemptions == ()
    assert plan.pending_reasons[9] == "Preempting: waiting for job(s) 1 to stop"
    assert plan.pending_reasons[10] == "Priority: queued behind job 9"


def test_preempt_suspend_resume_checkpoint_decisions() -> None:
    from singularityd.core.jobs import (
        Checkpointed,
        CheckpointFailed,
        CheckpointRequested,
        Note,
        PreemptRequested,
        RestoreFailed,
        ResumeRequested,
        TakeCheckpoint,
    )

    run = JobFacts(1, JobState.RUNNING)
    assert decide(run, PreemptRequested("alice"), 0).actions[-1] == TakeCheckpoint(stop=True, hold=False)
    assert decide(run, PreemptRequested("alice", hold=True), 0).actions[-1] == TakeCheckpoint(True, True)
    assert decide(run, CheckpointRequested("alice"), 0).actions[-1] == TakeCheckpoint(stop=False)
    done = decide(run, Checkpointed("preempted by alice: checkpoint 2 (10 MB)", stopped=True), 0)
    assert done.transition is not None and done.transition.to_state is JobState.PREEMPTED
    assert done.transition.reason == "preempted by alice: checkpoint 2 (10 MB); queued to resume"
    held = decide(run, Checkpointed("checkpoint 3", stopped=True, hold=True), 0)
    assert held.transition is not None and held.transition.to_state is JobState.SUSPENDED
    in_place = decide(run, Checkpointed("checkpoint 4", stopped=False), 0)
    assert in_place.transition is None and in_place.actions == (Note("checkpoint 4"),)
    failed = decide(run, CheckpointFailed("No space left on device"), 0)
    assert failed.transition is None
    assert failed.actions == (Note("checkpoint failed, the job keeps running: No space left on device"),)

    with pytest.raises(InvalidTransition, match="is PENDING; only a RUNNING job can be preempted"):
        decide(JobFacts(1, JobState.PENDING), PreemptRequested("alice"), 0)
    with pytest.raises(InvalidTransition, match="already being checkpointed"):
        decide(JobFacts(1, JobState.RUNNING, checkpointing=True), CheckpointRequested("a"), 0)
    with pytest.raises(InvalidTransition, match="checkpoints are unavailable"):
        decide(JobFacts(1, JobState.RUNNING, checkpoints_available=False), PreemptRequested("a"), 0)
    with pytest.raises(InvalidTransition, match="only a SUSPENDED job can be resumed"):
        decide(JobFacts(1, JobState.PREEMPTED, has_checkpoint=True), ResumeRequested("a"), 0)

    suspended = JobFacts(1, JobState.SUSPENDED, has_checkpoint=True)
    resumed = decide(suspended, ResumeRequested("alice"), 0)
    assert resumed.transition is not None and resumed.transition.to_state is JobState.PREEMPTED
    never_ran = decide(JobFacts(1, JobState.SUSPENDED), ResumeRequested("alice"), 0)
    assert never_ran.transition is not None and never_ran.transition.to_state is JobState.PENDING
    hold_pending = decide(JobFacts(1, JobState.PENDING), PreemptRequested("alice", hold=True), 0)
    assert hold_pending.transition is not None and hold_pending.transition.to_state is JobState.SUSPENDED

    restart = decide(JobFacts(1, JobState.PREEMPTED, has_checkpoint=True), Started((2,)), 0)
    assert (
        restart.transition is not None
        and restart.transition.reason == "resumed from its checkpoint on device 2"
    )
    lost = decide(JobFacts(1, JobState.RUNNING, has_checkpoint=True), ProcessesLost("gone"), 0)
    assert lost.transition is not None and lost.transition.to_state is JobState.PREEMPTED
    broken = decide(JobFacts(1, JobState.RUNNING, has_checkpoint=True), RestoreFailed("all corrupt"), 0)
    assert broken.transition is not None and broken.transition.reason == "cannot resume: all corrupt"
