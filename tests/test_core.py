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
from singularityd.core.policy import QueuedJob, plan_starts


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
