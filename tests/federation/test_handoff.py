"""The hand-off state machine: readable scenarios, then an exhaustive search of crashes and cuts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from singularityd.federation import handoff as h
from tests.federation import handoff_model as model

S = h.Settings(attempt_timeout_s=100.0, hold_s=150.0)


def run(
    holding: h.Holding | None, stimulus: h.Stimulus, now: float = 0.0
) -> tuple[h.Holding | None, list[h.Action]]:
    """Decide one stimulus for job j; return the holding to store and the actions."""
    decision = h.decide(holding, "j", stimulus, now, S)
    return decision.holding or holding, list(decision.actions)


def kinds(actions: list[h.Action]) -> list[str]:
    """Action class names, Notes left out."""
    return [type(a).__name__ for a in actions if not isinstance(a, h.Note)]


def happy_path() -> tuple[h.Holding, h.Holding]:
    """Source A and target B after a complete move of j at epoch 2."""
    a, acts = run(h.initial_holding("j"), h.MoveRequested("B"))
    assert a is not None and a.phase is h.Phase.OUT_PREPARING and a.epoch == 2
    assert h.Send(h.Step.PREPARE, "B", 2) in acts
    b, acts = run(None, h.PrepareReceived("A", 2))
    assert b is not None and b.phase is h.Phase.IN_PREPARED and h.transfer_refusal(b, "A", 2) == ""
    a, acts = run(a, h.StepAnswered(h.Step.PREPARE, 2, True))
    assert kinds(acts) == ["StopForMove"]
    a, acts = run(a, h.CheckpointReady(2))
    assert kinds(acts) == ["SendCheckpoint"]
    a, acts = run(a, h.TransferDone(2))
    assert a is not None and a.phase is h.Phase.OUT_RESTORING and kinds(acts) == ["Send"]
    b, acts = run(b, h.RestoreReceived("A", 2))
    assert kinds(acts) == ["RestoreFrozen"]
    b, acts = run(b, h.RestoreFinished(2))
    assert b is not None and b.phase is h.Phase.IN_RESTORED and kinds(acts) == ["Reply"]
    a, acts = run(a, h.StepAnswered(h.Step.RESTORE, 2, True))
    assert a is not None and a.phase is h.Phase.OUT_COMMITTED and h.Send(h.Step.COMMIT, "B", 2) in acts
    b, acts = run(b, h.CommitReceived("A", 2))
    assert b is not None and b.phase is h.Phase.OWNED and kinds(acts) == ["ReleaseFrozen", "Reply"]
    a, acts = run(a, h.StepAnswered(h.Step.COMMIT, 2, True))
    assert a is not None and a.phase is h.Phase.HANDED_OFF
    assert kinds(acts) == ["DropLocalCopy", "MoveFinished"] and h.MoveFinished(True, "B") in acts
    return a, b


def test_a_move_hands_the_job_over_only_at_the_commit() -> None:
    a, b = happy_path()
    assert not a.owns and b.owns and b.epoch == 2 and b.outcome(2) == "committed"


def test_the_target_refuses_what_it_cannot_host_and_the_job_keeps_running() -> None:
    a, _ = run(h.initial_holding("j"), h.MoveRequested("B"))
    b, acts = run(None, h.PrepareReceived("A", 2, "/home/ann/run is not a directory here"))
    assert b is None and acts == [h.Reply(h.Step.PREPARE, 2, False, "/home/ann/run is not a directory here")]
    a, acts = run(a, h.StepAnswered(h.Step.PREPARE, 2, False, "/home/ann/run is not a directory here"))
    assert a is not None and a.phase is h.Phase.OWNED and not a.abort_pending
    assert kinds(acts) == ["MoveFinished"] and "not a directory" in acts[-1].detail  # type: ignore[union-attr]


def test_anything_carrying_a_stale_epoch_is_refused() -> None:
    _, b = happy_path()
    for stimulus in (h.PrepareReceived("A", 2), h.PrepareReceived("C", 1), h.RestoreReceived("A", 1)):
        held, acts = run(b, stimulus)
        assert held == b and len(acts) == 1 and isinstance(acts[0], h.Reply) and not acts[0].ok
    # An old source's abort cannot take the job away from its new owner.
    held, acts = run(b, h.AbortReceived("A", 2))
    assert held == b and not acts[-1].ok  # type: ignore[union-attr]


def test_a_stale_owner_that_wakes_up_does_not_resume() -> None:
    """A source paused right after recording the commit finds, on waking, that the target runs the job."""
    _, b = happy_path()
    a_before_ack = h.Holding("j", 2, h.Phase.OUT_COMMITTED, "B")
    a, acts = run(a_before_ack, h.Recovered(), now=10_000.0)
    assert kinds(acts) == ["Send"] and a == a_before_ack  # it only tells the target again
    _, replies = run(b, h.CommitReceived("A", 2))
    assert replies == [h.Reply(h.Step.COMMIT, 2, True, recorded_epoch=2)]
    woken, acts = run(a, h.StepAnswered(h.Step.COMMIT, 2, True))
    assert woken is not None and not woken.owns and "ResumeHere" not in kinds(acts)


def test_a_target_that_gave_up_lets_the_source_take_the_job_back() -> None:
    held = h.Holding("j", 2, h.Phase.IN_RESTORED, "A", deadline=150.0)
    b, acts = run(held, h.Tick(), now=151.0)
    assert b is not None and b.phase is h.Phase.DISCARDED and kinds(acts) == ["DiscardIncoming"]
    _, acts = run(b, h.CommitReceived("A", 2), now=152.0)
    assert acts == [h.Reply(h.Step.COMMIT, 2, False, "epoch 2 was discarded here", True, 2)]
    a, acts = run(
        h.Holding("j", 2, h.Phase.OUT_COMMITTED, "B"), h.StepAnswered(h.Step.COMMIT, 2, False, "", True)
    )
    assert a is not None and a.phase is h.Phase.OWNED and "ResumeHere" in kinds(acts)


def test_a_source_never_commits_after_its_deadline() -> None:
    late = h.Holding("j", 2, h.Phase.OUT_RESTORING, "B", deadline=100.0)
    a, acts = run(late, h.StepAnswered(h.Step.RESTORE, 2, True), now=101.0)
    assert a is not None and a.phase is h.Phase.OWNED and a.abort_pending
    assert kinds(acts) == ["ResumeHere", "Send", "MoveFinished"] and h.Send(h.Step.ABORT, "B", 2) in acts


def test_only_the_owner_can_start_a_move() -> None:
    with pytest.raises(h.InvalidRequest, match="not owned"):
        h.decide(None, "j", h.MoveRequested("B"), 0.0, S)
    with pytest.raises(h.InvalidRequest, match="already moving"):
        h.decide(h.Holding("j", 2, h.Phase.OUT_PREPARING, "B"), "j", h.MoveRequested("C"), 0.0, S)
    with pytest.raises(h.InvalidRequest, match="not owned"):
        h.decide(h.Holding("j", 2, h.Phase.HANDED_OFF, "B"), "j", h.MoveRequested("C"), 0.0, S)


def test_a_node_that_owns_the_job_refuses_to_receive_it() -> None:
    held, acts = run(h.initial_holding("j"), h.PrepareReceived("B", 5))
    assert held == h.initial_holding("j") and not acts[0].ok  # type: ignore[union-attr]
    assert "owns job j" in acts[0].reason  # type: ignore[union-attr]


def test_a_commit_for_an_epoch_never_held_fences_it() -> None:
    b, acts = run(None, h.CommitReceived("A", 4))
    assert b is not None and b.outcome(4) == "discarded" and acts[-1].discarded  # type: ignore[union-attr]
    b, acts = run(b, h.PrepareReceived("A", 4))
    assert not acts[-1].ok  # type: ignore[union-attr]


def test_restarts_redo_interrupted_cleanups() -> None:
    _, acts = run(h.Holding("j", 2, h.Phase.HANDED_OFF, "B"), h.Recovered())
    assert kinds(acts) == ["DropLocalCopy"]
    _, acts = run(h.Holding("j", 3, h.Phase.IN_RESTORED, "A", discarded=(2,)), h.Recovered())
    assert h.DiscardIncoming(2) in acts
    b, acts = run(h.Holding("j", 3, h.Phase.IN_PREPARED, "A"), h.Recovered())
    assert b is not None and b.phase is h.Phase.DISCARDED and h.DiscardIncoming(3) in acts


# Exhaustive search: every interleaving of the two daemons, the link and the faults.


def test_every_crash_and_cut_during_one_move_keeps_exactly_one_copy() -> None:
    """Two crashes, two link cuts and a deadline expiry anywhere in a move from A to B."""
    seen = model.explore(model.Budget(crashes=2, cuts=2, time_jumps=1))
    source_phases = {
        "owned",
        "out-preparing",
        "out-transferring",
        "out-restoring",
        "out-committed",
        "handed-off",
    }
    target_phases = {"none", "in-prepared", "in-restoring", "in-restored", "owned", "discarded"}
    assert {p for n, p in seen.crash_points if n == "A"} >= source_phases
    assert {p for n, p in seen.crash_points if n == "B"} >= target_phases
    assert seen.cut_points == {"PREPARE", "RESTORE", "COMMIT", "ABORT"}
    assert seen.settled > 1 and seen.states > 10_000


@pytest.mark.slow
def test_every_fault_during_two_moves_keeps_exactly_one_copy() -> None:
    """Two moves (there and back, or twice), with refusals, failed local work, a crash, a cut, a deadline."""
    seen = model.explore(model.Budget(crashes=1, cuts=1, time_jumps=1, work_failures=1, refusals=1, moves=2))
    assert {n for n, p in seen.crash_points if p == "out-committed"} == {"A", "B"}
    assert seen.states > 100_000


def test_the_model_catches_a_machine_that_runs_the_job_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The search is able to fail: a target that runs the job on RESTORE (before the commit) is caught."""
    original = h.decide

    def eager(holding: h.Holding | None, job: str, s: h.Stimulus, now: float, st: h.Settings) -> h.Decision:
        decision = original(holding, job, s, now, st)
        if isinstance(s, h.RestoreFinished) and not s.error:
            return h.Decision(decision.holding, (*decision.actions, h.ReleaseFrozen(s.epoch)))
        return decision

    monkeypatch.setattr(h, "decide", eager)
    with pytest.raises(model.Violation, match=r"two live copies|without owning"):
        model.explore(model.Budget(cuts=1))


def restoring_at_source() -> h.Holding:
    """Source A with j's checkpoint sent to B at epoch 2 and RESTORE asked (at time 10)."""
    a, _ = run(h.initial_holding("j"), h.MoveRequested("B"))
    a, _ = run(a, h.StepAnswered(h.Step.PREPARE, 2, True), now=10.0)
    a, _ = run(a, h.CheckpointReady(2), now=10.0)
    a, _ = run(a, h.TransferDone(2), now=10.0)
    assert a is not None and a.phase is h.Phase.OUT_RESTORING
    assert a.peer_hold_ends == 10.0 + S.hold_s + S.hold_margin_s
    return a


def test_an_abort_during_the_restore_resumes_only_once_the_target_cannot_run_its_copy() -> None:
    """RESTORE got no answer (a cut link): B may be restoring. A resumes the job when B confirms
    the abort, or when B's hold has ended by A's clock - not before, however often it ticks."""
    a0 = restoring_at_source()
    a, acts = run(a0, h.StepFailed(h.Step.RESTORE, 2, "UNAVAILABLE"), now=20.0)
    assert a is not None and a.phase is h.Phase.OWNED and a.resume_pending and a.abort_pending
    assert "ResumeHere" not in kinds(acts) and h.Send(h.Step.ABORT, "B", 2) in acts
    with pytest.raises(h.InvalidRequest, match="cannot move yet"):
        run(a, h.MoveRequested("C"), now=21.0)
    waiting, acts = run(a, h.Tick(), now=a.peer_hold_ends - 0.1)
    assert kinds(acts) == ["Send"] and waiting == a
    late, acts = run(a, h.Tick(), now=a.peer_hold_ends)
    assert late is not None and not late.resume_pending and kinds(acts) == ["ResumeHere", "Send"]
    confirmed, acts = run(a, h.StepAnswered(h.Step.ABORT, 2, True), now=21.0)
    assert confirmed is not None and not confirmed.resume_pending and not confirmed.abort_pending
    assert kinds(acts) == ["ResumeHere"]


def test_an_abort_before_the_restore_was_asked_resumes_at_once() -> None:
    a, _ = run(h.initial_holding("j"), h.MoveRequested("B"))
    a, _ = run(a, h.StepAnswered(h.Step.PREPARE, 2, True), now=10.0)
    a, acts = run(a, h.MoveWorkFailed(2, "transfer failed"), now=11.0)
    assert a is not None and not a.resume_pending and "ResumeHere" in kinds(acts)


def test_a_restore_refused_as_discarded_resumes_at_once() -> None:
    refused = h.StepAnswered(h.Step.RESTORE, 2, False, "restore failed", discarded=True)
    a, acts = run(restoring_at_source(), refused, now=11.0)
    assert a is not None and not a.resume_pending and "ResumeHere" in kinds(acts)


def test_a_source_restarted_while_waiting_waits_a_whole_hold_again() -> None:
    # Its clock may have restarted with it: the stored moment is not trusted.
    a, acts = run(restoring_at_source(), h.Recovered(), now=5.0)
    assert a is not None and a.resume_pending and "ResumeHere" not in kinds(acts)
    assert a.peer_hold_ends == 5.0 + S.hold_s + S.hold_margin_s
    again, acts = run(a, h.Recovered(), now=7.0)
    assert again is not None and again.peer_hold_ends == 7.0 + S.hold_s + S.hold_margin_s
    assert "ResumeHere" not in kinds(acts)


def restored_at_target(hold_s: float = 0.0) -> h.Holding:
    """Target B holding j restored frozen for epoch 2 (PREPARE accepted at time 10)."""
    b, _ = run(None, h.PrepareReceived("A", 2, "", hold_s), now=10.0)
    b, _ = run(b, h.RestoreReceived("A", 2), now=11.0)
    b, _ = run(b, h.RestoreFinished(2), now=12.0)
    assert b is not None and b.phase is h.Phase.IN_RESTORED
    return b


def test_the_target_lets_its_copy_run_only_while_it_holds_it() -> None:
    """The hold starts at PREPARE, lasts what the source asked (at most our own), is not extended by
    the restore, and a commit after it ends discards the copy instead of letting it run."""
    b = restored_at_target(hold_s=60.0)
    assert b.deadline == 70.0
    assert restored_at_target(hold_s=1e6).deadline == 10.0 + S.hold_s
    b2, acts = run(b, h.CommitReceived("A", 2), now=70.5)
    assert b2 is not None and b2.phase is h.Phase.DISCARDED and b2.outcome(2) == "discarded"
    assert kinds(acts) == ["DiscardIncoming", "Reply"] and "ReleaseFrozen" not in kinds(acts)
    (reply,) = [a for a in acts if isinstance(a, h.Reply)]
    assert not reply.ok and reply.discarded
    owned, acts = run(b, h.CommitReceived("A", 2), now=69.0)
    assert owned is not None and owned.phase is h.Phase.OWNED and "ReleaseFrozen" in kinds(acts)


def test_a_restore_that_ends_after_the_hold_is_discarded() -> None:
    b, _ = run(None, h.PrepareReceived("A", 2, "", 30.0), now=10.0)
    b, _ = run(b, h.RestoreReceived("A", 2), now=11.0)
    b, acts = run(b, h.RestoreFinished(2), now=41.0)
    assert b is not None and b.phase is h.Phase.DISCARDED and kinds(acts) == ["DiscardIncoming", "Reply"]


def test_a_target_restarted_while_holding_gives_its_copy_up() -> None:
    b, acts = run(restored_at_target(), h.Recovered(), now=13.0)
    assert b is not None and b.phase is h.Phase.DISCARDED and "DiscardIncoming" in kinds(acts)


def test_the_model_catches_a_source_that_resumes_while_the_target_may_restore(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The search is able to fail: a source resuming as soon as it aborts during the restore is caught."""
    original = h.decide

    def hasty(holding: h.Holding | None, job: str, s: h.Stimulus, now: float, st: h.Settings) -> h.Decision:
        decision = original(holding, job, s, now, st)
        if decision.holding is not None and decision.holding.resume_pending:
            resumed = replace(decision.holding, resume_pending=False)
            return h.Decision(resumed, (*decision.actions, h.ResumeHere()))
        return decision

    monkeypatch.setattr(h, "decide", hasty)
    with pytest.raises(model.Violation, match="may still let run"):
        model.explore(model.Budget(cuts=1, time_jumps=1))
