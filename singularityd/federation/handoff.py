"""Ownership of a job and its two-phase hand-off between daemons: pure decisions, no I/O.

Each daemon keeps one `Holding` per job it has ever seen: the highest epoch it has recorded for
the job and what it is doing with it. The daemon feeds a holding and one stimulus to `decide`,
stores the holding it returns (before anything else), then carries out the actions in order.

A move is decided by the source alone:

    source                                   target
    OWNED e --MoveRequested--> OUT_PREPARING e+1 --PREPARE--> IN_PREPARED e+1 (can host? same cwd?)
    OUT_TRANSFERRING (stop the job, send its checkpoint) ......> files arrive
    OUT_RESTORING --RESTORE--> IN_RESTORING --> IN_RESTORED (restored frozen, held)
    OUT_COMMITTED (the decision, stored) --COMMIT--> OWNED e+1: only now the job runs there
    HANDED_OFF (local copy dropped once the target acknowledged)

Safety never depends on the failure detector or on how long anything takes:
- the target runs a job only on a COMMIT for an epoch it holds restored, and only while it holds
  it: its hold starts when it accepts PREPARE, lasts at most the `hold_s` the source asked for,
  is never extended (a restart gives it up), and ends in a discard, never a release;
- the target records whether each incoming epoch was committed or discarded before answering,
  so it never does both;
- the source resumes the job itself only when it has recorded an abort (it never commits after
  that) AND it knows the target's copy of the epoch can never run: no RESTORE was ever sent for
  it, or the target answered that it aborted or discarded it (its copy is then dead), or the
  target's hold has provably ended - `peer_hold_ends`, measured on the source's own clock from
  the moment PREPARE's answer arrived (after the target's hold began) plus the hold and a margin;
- the source keeps its own copy until the target acknowledged the commit;
- every request carries an epoch; anything carrying an epoch the receiver has passed is refused.
Both sides measure with a clock that never jumps (the driver's: CLOCK_BOOTTIME); a daemon that
restarts never trusts a deadline stored by the process before it: the source waits a whole hold
again, the target gives up what it held. Deadlines otherwise bring liveness: a source gives up
on a hand-off that takes too long (abort), a target stops holding a frozen copy whose commit does
not come (discard). A source that was paused or crashed and comes back finds its records and
follows them: after a commit it never resumes the job, only retries telling the target, and takes
the job back only if the target says it discarded that epoch.

The steps, stimuli and actions are defined in `handoff_messages` and re-exported here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from singularityd.federation.handoff_messages import (
    AbortReceived,
    Action,
    CheckpointReady,
    CommitReceived,
    DiscardIncoming,
    DropLocalCopy,
    MoveFinished,
    MoveRequested,
    MoveWorkFailed,
    Note,
    PrepareReceived,
    Recovered,
    ReleaseFrozen,
    Reply,
    RestoreFinished,
    RestoreFrozen,
    RestoreReceived,
    ResumeHere,
    Send,
    SendCheckpoint,
    Step,
    StepAnswered,
    StepFailed,
    Stimulus,
    StopForMove,
    Tick,
    TransferDone,
)

__all__ = [
    "ABORTABLE",
    "HISTORY",
    "INCOMING",
    "OWNING",
    "AbortReceived",
    "Action",
    "CheckpointReady",
    "CommitReceived",
    "Decision",
    "DiscardIncoming",
    "DropLocalCopy",
    "Holding",
    "InvalidRequest",
    "MoveFinished",
    "MoveRequested",
    "MoveWorkFailed",
    "Note",
    "Phase",
    "PrepareReceived",
    "Recovered",
    "ReleaseFrozen",
    "Reply",
    "RestoreFinished",
    "RestoreFrozen",
    "RestoreReceived",
    "ResumeHere",
    "Send",
    "SendCheckpoint",
    "Settings",
    "Step",
    "StepAnswered",
    "StepFailed",
    "Stimulus",
    "StopForMove",
    "Tick",
    "TransferDone",
    "decide",
    "initial_holding",
    "transfer_refusal",
]

HISTORY = 16


class Phase(enum.StrEnum):
    """What this daemon is doing with a job."""

    OWNED = "owned"
    OUT_PREPARING = "out-preparing"
    OUT_TRANSFERRING = "out-transferring"
    OUT_RESTORING = "out-restoring"
    OUT_COMMITTED = "out-committed"
    HANDED_OFF = "handed-off"
    IN_PREPARED = "in-prepared"
    IN_RESTORING = "in-restoring"
    IN_RESTORED = "in-restored"
    DISCARDED = "discarded"


ABORTABLE = frozenset({Phase.OUT_PREPARING, Phase.OUT_TRANSFERRING, Phase.OUT_RESTORING})
INCOMING = frozenset({Phase.IN_PREPARED, Phase.IN_RESTORING, Phase.IN_RESTORED})
OWNING = frozenset({Phase.OWNED, *ABORTABLE, Phase.OUT_COMMITTED})


class InvalidRequest(ValueError):
    """A local request (a move) that the job's ownership does not allow."""


@dataclass(frozen=True)
class Settings:
    """How long a source waits for a hand-off, and a target holds what it received."""

    attempt_timeout_s: float = 600.0
    hold_s: float = 900.0
    hold_margin_s: float = 2.0
    """How much longer than a target's hold a source waits, for the two clocks' drift."""


@dataclass(frozen=True)
class Holding:
    """One daemon's durable record of one job's ownership."""

    job_id: str
    epoch: int
    phase: Phase
    peer: str = ""
    deadline: float = 0.0
    abort_pending: bool = False
    committed: tuple[int, ...] = ()
    discarded: tuple[int, ...] = ()
    peer_hold_ends: float = 0.0
    """Source: when the target's hold on this epoch has provably ended, by this node's clock."""
    resume_pending: bool = False
    """Source: the move was aborted, and the job resumes here once the target's copy cannot run."""

    @property
    def owns(self) -> bool:
        """Whether this daemon is the job's owner (it may run it, or it is deciding a move)."""
        return self.phase in OWNING

    def outcome(self, epoch: int) -> str:
        """'committed' or 'discarded' for an incoming epoch this daemon settled, else ''."""
        if epoch in self.committed:
            return "committed"
        if epoch in self.discarded:
            return "discarded"
        return ""


def initial_holding(job_id: str) -> Holding:
    """The holding of a job submitted here: owned, epoch 1."""
    return Holding(job_id, 1, Phase.OWNED)


@dataclass(frozen=True)
class Decision:
    """The holding to store first (None: unchanged) and the actions to carry out after."""

    holding: Holding | None = None
    actions: tuple[Action, ...] = field(default_factory=tuple)


def _remember(history: tuple[int, ...], epoch: int) -> tuple[int, ...]:
    return (*history, epoch)[-HISTORY:] if epoch not in history else history


def _abort(h: Holding, reason: str, now: float) -> Decision:
    """Record the abort of the current attempt, take the job back, and tell the target.

    The job resumes here at once unless the target may hold a restored copy (RESTORE was sent)
    whose hold has not provably ended: then only once the target confirms the abort, or its hold
    ends (`_resume_if_safe`).
    """
    actions: list[Action] = [Note(f"move to {h.peer} aborted: {reason}")]
    waiting = h.phase is Phase.OUT_RESTORING and now < h.peer_hold_ends
    if h.phase is Phase.OUT_TRANSFERRING or (h.phase is Phase.OUT_RESTORING and not waiting):
        actions.append(ResumeHere())
    if waiting:
        why = f"{h.peer} may hold a restored copy until it confirms the abort or its hold ends"
        actions.append(Note(f"{why} (in {h.peer_hold_ends - now:.0f}s); the job resumes here then"))
    actions += [Send(Step.ABORT, h.peer, h.epoch), MoveFinished(False, reason)]
    aborted = replace(h, phase=Phase.OWNED, deadline=0.0, abort_pending=True, resume_pending=waiting)
    return Decision(aborted, tuple(actions))


def _resume_if_safe(h: Holding, now: float, confirmed: bool) -> tuple[Holding, tuple[Action, ...]]:
    """Resume an aborted job here once the target's copy can never run: the target `confirmed`
    the abort (its copy is dead), or its hold has provably ended by our clock."""
    if not h.resume_pending or not (confirmed or now >= h.peer_hold_ends):
        return h, ()
    why = f"the hold of {h.peer} on epoch {h.epoch} has ended"
    if confirmed:
        why = f"{h.peer} confirmed the abort"
    return replace(h, resume_pending=False), (Note(f"{why}; resuming here"), ResumeHere())


def _refuse(h: Holding | None, step: Step, epoch: int, reason: str, *, discarded: bool = False) -> Reply:
    return Reply(step, epoch, False, reason, discarded, h.epoch if h else 0)


def _stale(h: Holding, step: Step, epoch: int) -> Decision:
    reason = f"stale epoch {epoch} for job {h.job_id}: this node has recorded epoch {h.epoch}"
    return Decision(actions=(_refuse(h, step, epoch, reason),))


def decide(h: Holding | None, job_id: str, stimulus: Stimulus, now: float, settings: Settings) -> Decision:
    """Decide what one stimulus does to a job's holding here: the record to store, the actions to take."""
    match stimulus:
        case MoveRequested() | StepAnswered() | StepFailed() | CheckpointReady() | TransferDone():
            return _source(h, job_id, stimulus, now, settings)
        case MoveWorkFailed() | Tick() | Recovered():
            return _source(h, job_id, stimulus, now, settings) if h is not None else Decision()
        case PrepareReceived() | RestoreReceived() | RestoreFinished() | CommitReceived() | AbortReceived():
            return _target(h, job_id, stimulus, now, settings)
    raise TypeError(f"unknown stimulus {stimulus!r}")


def _source(h: Holding | None, job_id: str, s: Stimulus, now: float, settings: Settings) -> Decision:
    """Stimuli of this daemon's own making: moves, answers to our requests, our local work, time."""
    if h is None:
        if isinstance(s, MoveRequested):
            raise InvalidRequest(f"job {job_id} is not owned by this node")
        return Decision()
    match s:
        case MoveRequested(target=target):
            if h.phase is not Phase.OWNED:
                if h.owns:
                    raise InvalidRequest(f"job {job_id} is already moving to {h.peer}")
                raise InvalidRequest(f"job {job_id} is not owned by this node ({h.phase})")
            if h.resume_pending:
                why = f"its copy on {h.peer} may still be held there; it resumes here first"
                raise InvalidRequest(f"job {job_id} cannot move yet: {why}")
            epoch = h.epoch + 1
            deadline = now + settings.attempt_timeout_s
            moving = replace(h, epoch=epoch, phase=Phase.OUT_PREPARING, peer=target, deadline=deadline)
            moving = replace(moving, abort_pending=False, peer_hold_ends=0.0)
            note = Note(f"move to {target} started (epoch {epoch})")
            return Decision(moving, (note, Send(Step.PREPARE, target, epoch)))
        case StepAnswered(epoch=epoch) if epoch != h.epoch:
            return Decision()
        case StepAnswered(step=Step.PREPARE, ok=ok, reason=reason, target_epoch=target_epoch):
            if h.phase is not Phase.OUT_PREPARING:
                return Decision()
            if not ok:
                taken_back = replace(h, phase=Phase.OWNED, deadline=0.0, epoch=max(h.epoch, target_epoch))
                why = f"{h.peer} refused the job: {reason}"
                return Decision(
                    taken_back, (Note(f"move to {h.peer} refused: {reason}"), MoveFinished(False, why))
                )
            # The target's hold began before its answer arrived: it has ended by then at the latest.
            hold_ends = now + settings.hold_s + settings.hold_margin_s
            transferring = replace(h, phase=Phase.OUT_TRANSFERRING, peer_hold_ends=hold_ends)
            return Decision(
                transferring, (Note(f"{h.peer} accepted the job; stopping it"), StopForMove(h.epoch))
            )
        case StepAnswered(step=Step.RESTORE, ok=ok, reason=reason, discarded=discarded):
            if h.phase is not Phase.OUT_RESTORING:
                return Decision()
            if not ok:
                aborted = _abort(h, f"{h.peer} could not restore the job: {reason}", now)
                assert aborted.holding is not None
                settled, resumed = _resume_if_safe(aborted.holding, now, confirmed=discarded)
                return Decision(settled, (*aborted.actions, *resumed))
            if now > h.deadline:
                return _abort(h, "the move took longer than its deadline", now)
            committed = replace(h, phase=Phase.OUT_COMMITTED, deadline=0.0)
            return Decision(
                committed, (Note(f"commit to {h.peer} recorded"), Send(Step.COMMIT, h.peer, h.epoch))
            )
        case StepAnswered(step=Step.COMMIT, ok=ok, reason=reason, discarded=discarded):
            if h.phase is not Phase.OUT_COMMITTED:
                return Decision()
            if ok:
                done = replace(h, phase=Phase.HANDED_OFF)
                return Decision(
                    done,
                    (
                        Note(f"moved to {h.peer} (epoch {h.epoch})"),
                        DropLocalCopy(h.peer),
                        MoveFinished(True, h.peer),
                    ),
                )
            if discarded:
                back = replace(h, phase=Phase.OWNED, deadline=0.0)
                why = f"{h.peer} gave the job up before the commit reached it"
                return Decision(back, (Note(f"{why}; resuming here"), ResumeHere(), MoveFinished(False, why)))
            return Decision(actions=(Note(f"{h.peer} refused the commit ({reason}); will retry"),))
        case StepAnswered(step=Step.ABORT, ok=ok, reason=reason):
            if h.phase is not Phase.OWNED or not h.abort_pending:
                return Decision()
            if not ok:
                refused = Note(f"{h.peer} refused the abort: {reason}")
                return Decision(replace(h, abort_pending=False), (refused,))
            settled, resumed = _resume_if_safe(replace(h, abort_pending=False), now, confirmed=True)
            return Decision(settled, resumed)
        case StepFailed(step=step, epoch=epoch, error=error):
            if epoch != h.epoch:
                return Decision()
            if step is Step.PREPARE and h.phase is Phase.OUT_PREPARING:
                return _abort(h, f"no answer from {h.peer} to PREPARE: {error}", now)
            if step is Step.RESTORE and h.phase is Phase.OUT_RESTORING:
                return _abort(h, f"no answer from {h.peer} to RESTORE: {error}", now)
            return Decision()
        case CheckpointReady(epoch=epoch):
            if h.phase is Phase.OUT_TRANSFERRING and epoch == h.epoch:
                note = Note("job stopped; sending its checkpoint")
                return Decision(actions=(note, SendCheckpoint(h.peer, epoch)))
            return _stopped_for_nothing(h)
        case TransferDone(epoch=epoch):
            if h.phase is not Phase.OUT_TRANSFERRING or epoch != h.epoch:
                return Decision()
            restoring = replace(h, phase=Phase.OUT_RESTORING)
            return Decision(restoring, (Note("checkpoint transferred"), Send(Step.RESTORE, h.peer, epoch)))
        case MoveWorkFailed(epoch=epoch, error=error):
            if h.phase in ABORTABLE and epoch == h.epoch:
                return _abort(h, error, now)
            return _stopped_for_nothing(h)
        case Tick():
            return _tick(h, now)
        case Recovered():
            return _recover(h, now, settings)
    return Decision()


def _stopped_for_nothing(h: Holding) -> Decision:
    """Local move work of an abandoned attempt ended: the job may be stopped although it should run."""
    if h.phase in (Phase.OWNED, Phase.OUT_PREPARING) and not h.resume_pending:
        return Decision(actions=(ResumeHere(),))
    return Decision()


def _tick(h: Holding, now: float) -> Decision:
    if h.phase in ABORTABLE and now > h.deadline:
        return _abort(h, "the move took longer than its deadline", now)
    if h.phase is Phase.OUT_COMMITTED:
        return Decision(actions=(Send(Step.COMMIT, h.peer, h.epoch),))
    if h.phase is Phase.OWNED and (h.abort_pending or h.resume_pending):
        settled, resumed = _resume_if_safe(h, now, confirmed=False)
        resend = (Send(Step.ABORT, h.peer, h.epoch),) if h.abort_pending else ()
        return Decision(settled if resumed else None, (*resumed, *resend))
    if h.phase in INCOMING and now > h.deadline:
        return _discard(h, "no commit came in time")
    return Decision()


def _recover(h: Holding, now: float, settings: Settings) -> Decision:
    """After a restart: finish or undo what the records say was under way, and redo clean-ups.

    Every clean-up is idempotent, so a crash anywhere in an action list is made good here.
    """
    decision = _resume_after_restart(h, now, settings)
    holding = decision.holding or h
    cleanups = tuple(
        DiscardIncoming(e) for e in holding.discarded if DiscardIncoming(e) not in decision.actions
    )
    return Decision(decision.holding, (*decision.actions, *cleanups))


def _resume_after_restart(h: Holding, now: float, settings: Settings) -> Decision:
    # A deadline stored by the process before this one is not trusted: a whole hold is waited again.
    rearmed = replace(h, peer_hold_ends=now + settings.hold_s + settings.hold_margin_s)
    if h.phase is Phase.OUT_RESTORING:
        return _abort(rearmed, "this daemon restarted in the middle of the move", now)
    if h.phase in ABORTABLE:
        decision = _abort(h, "this daemon restarted in the middle of the move", now)
        # The job may have been stopped by an interrupted StopForMove: always make sure it runs.
        rest = tuple(a for a in decision.actions if not isinstance(a, ResumeHere))
        return Decision(decision.holding, (ResumeHere(), *rest))
    if h.phase is Phase.OUT_COMMITTED:
        note = Note("restarted after the commit; telling the target again")
        return Decision(actions=(note, Send(Step.COMMIT, h.peer, h.epoch)))
    if h.phase is Phase.OWNED:
        resend = (Send(Step.ABORT, h.peer, h.epoch),) if h.abort_pending else ()
        if h.resume_pending:
            note = Note(f"restarted while {h.peer} may hold a copy; the job resumes once it cannot run")
            return Decision(rearmed, (note, *resend))
        # A crash may have cut short the release of a committed job or the resume after an abort.
        actions: list[Action] = [ReleaseFrozen(h.epoch)] if h.epoch in h.committed else []
        actions.append(ResumeHere())
        return Decision(actions=(*actions, *resend))
    if h.phase in (Phase.IN_PREPARED, Phase.IN_RESTORING):
        return _discard(h, "this daemon restarted before the job was restored")
    if h.phase is Phase.IN_RESTORED:
        # How long it held the copy before the restart is not known: the hold ends here.
        return _discard(h, "this daemon restarted while it held the job; its hold ends")
    if h.phase is Phase.HANDED_OFF:
        return Decision(actions=(DropLocalCopy(h.peer),))
    return Decision()


def _discard(h: Holding, reason: str) -> Decision:
    """Give up an incoming epoch for good (recorded first, so it can never run here)."""
    gone = replace(h, phase=Phase.DISCARDED, deadline=0.0, discarded=_remember(h.discarded, h.epoch))
    return Decision(
        gone, (Note(f"dropped the incoming job from {h.peer}: {reason}"), DiscardIncoming(h.epoch))
    )


def _target(h: Holding | None, job_id: str, s: Stimulus, now: float, settings: Settings) -> Decision:
    """Requests from a source, and the end of our own restore."""
    match s:
        case PrepareReceived(source=source, epoch=epoch, problem=problem):
            if h is not None and h.owns:
                why = f"this node owns job {job_id} (epoch {h.epoch}); it cannot take it from {source}"
                return Decision(actions=(_refuse(h, Step.PREPARE, epoch, why),))
            if h is not None and epoch <= h.epoch:
                if h.phase is Phase.IN_PREPARED and epoch == h.epoch and source == h.peer:
                    return Decision(actions=(Reply(Step.PREPARE, epoch, True, recorded_epoch=h.epoch),))
                return _stale(h, Step.PREPARE, epoch)
            if problem:
                return Decision(actions=(_refuse(h, Step.PREPARE, epoch, problem),))
            actions: list[Action] = []
            base = h or Holding(job_id, 0, Phase.DISCARDED)
            if h is not None and h.phase in INCOMING:
                superseded = _discard(h, f"superseded by epoch {epoch}")
                assert superseded.holding is not None
                base = superseded.holding
                actions += superseded.actions
            hold_s = min(settings.hold_s, s.hold_s) if s.hold_s > 0 else settings.hold_s
            prepared = replace(base, epoch=epoch, phase=Phase.IN_PREPARED, peer=source, deadline=now + hold_s)
            actions.append(Note(f"accepted the job from {source} (epoch {epoch})"))
            actions.append(Reply(Step.PREPARE, epoch, True, recorded_epoch=epoch))
            return Decision(prepared, tuple(actions))
        case RestoreReceived(source=source, epoch=epoch):
            if h is None or h.epoch != epoch or h.peer != source or h.phase not in INCOMING:
                return _not_holding(h, Step.RESTORE, epoch)
            if h.phase is Phase.IN_RESTORED:
                return Decision(actions=(Reply(Step.RESTORE, epoch, True, recorded_epoch=epoch),))
            if h.phase is Phase.IN_RESTORING:
                return Decision()
            restoring = replace(h, phase=Phase.IN_RESTORING)
            return Decision(restoring, (Note("restoring the job frozen"), RestoreFrozen(epoch)))
        case RestoreFinished(epoch=epoch, error=error):
            if h is None or h.phase is not Phase.IN_RESTORING or h.epoch != epoch:
                reason = f"epoch {epoch} of job {job_id} was dropped during the restore"
                return Decision(
                    actions=(DiscardIncoming(epoch), Reply(Step.RESTORE, epoch, False, reason, True))
                )
            if error or now > h.deadline:
                why = f"restore failed: {error}" if error else "restored after the hold ended"
                dropped = _discard(h, why)
                refusal = _refuse(h, Step.RESTORE, epoch, why, discarded=True)
                return Decision(dropped.holding, (*dropped.actions, refusal))
            held = replace(h, phase=Phase.IN_RESTORED)
            return Decision(
                held,
                (
                    Note("restored frozen; waiting for the commit"),
                    Reply(Step.RESTORE, epoch, True, recorded_epoch=epoch),
                ),
            )
        case CommitReceived(source=source, epoch=epoch):
            if h is not None and h.outcome(epoch) == "committed":
                return Decision(actions=(Reply(Step.COMMIT, epoch, True, recorded_epoch=h.epoch),))
            ours = h is not None and (h.epoch, h.peer) == (epoch, source)
            frozen_here = ours and h is not None and h.phase is Phase.IN_RESTORED
            if h is not None and frozen_here and now > h.deadline:
                # The job runs here only while it is held: once the hold has ended it never does.
                dropped = _discard(h, "the commit came after the hold ended")
                refusal = _refuse(h, Step.COMMIT, epoch, f"the hold on epoch {epoch} ended", discarded=True)
                return Decision(dropped.holding, (*dropped.actions, refusal))
            if h is not None and frozen_here:
                owned = replace(h, phase=Phase.OWNED, deadline=0.0, committed=_remember(h.committed, epoch))
                note = Note(f"commit from {source}: the job runs here (epoch {epoch})")
                reply = Reply(Step.COMMIT, epoch, True, recorded_epoch=epoch)
                return Decision(owned, (note, ReleaseFrozen(epoch), reply))
            if h is not None and h.epoch == epoch and h.peer == source and h.phase in INCOMING:
                return Decision(actions=(_refuse(h, Step.COMMIT, epoch, "the job is not restored yet"),))
            return _fence(h, job_id, Step.COMMIT, epoch)
        case AbortReceived(source=source, epoch=epoch):
            if h is not None and h.outcome(epoch) == "committed":
                reason = f"epoch {epoch} of job {job_id} was committed here"
                return Decision(actions=(_refuse(h, Step.ABORT, epoch, reason),))
            if h is not None and h.epoch == epoch and h.phase in INCOMING:
                dropped = _discard(h, f"{source} aborted the move")
                return Decision(
                    dropped.holding, (*dropped.actions, Reply(Step.ABORT, epoch, True, recorded_epoch=epoch))
                )
            # Whatever the reason we do not hold the epoch, it can never run here: the abort is done.
            fenced = _fence(h, job_id, Step.ABORT, epoch)
            acknowledged = tuple(replace(a, ok=True) if isinstance(a, Reply) else a for a in fenced.actions)
            return Decision(fenced.holding, acknowledged)
    return Decision()


def _not_holding(h: Holding | None, step: Step, epoch: int) -> Decision:
    if h is not None and h.outcome(epoch) == "discarded":
        return Decision(
            actions=(_refuse(h, step, epoch, f"epoch {epoch} was discarded here", discarded=True),)
        )
    if h is not None and epoch < h.epoch:
        return _stale(h, step, epoch)
    return Decision(actions=(_refuse(h, step, epoch, f"this node holds no incoming job at epoch {epoch}"),))


def _fence(h: Holding | None, job_id: str, step: Step, epoch: int) -> Decision:
    """Answer a COMMIT or ABORT for an epoch we do not hold: make sure it can never run here."""
    if h is not None and h.outcome(epoch) == "discarded":
        return Decision(
            actions=(_refuse(h, step, epoch, f"epoch {epoch} was discarded here", discarded=True),)
        )
    if h is not None and (h.owns or epoch < h.epoch):
        return _stale(h, step, epoch)
    if h is not None and epoch == h.epoch:
        reason = f"epoch {epoch} of job {job_id} is held here for {h.peer or 'another node'}"
        return Decision(actions=(_refuse(h, step, epoch, reason),))
    base = h or Holding(job_id, 0, Phase.DISCARDED)
    actions: list[Action] = []
    if base.phase in INCOMING:
        superseded = _discard(base, f"superseded by epoch {epoch}")
        assert superseded.holding is not None
        base = superseded.holding
        actions += superseded.actions
    fenced = replace(base, epoch=epoch, discarded=_remember(base.discarded, epoch))
    reason = f"this node never held epoch {epoch} of job {job_id}; it will not run it"
    return Decision(fenced, (*actions, _refuse(h, step, epoch, reason, discarded=True)))


def transfer_refusal(h: Holding | None, source: str, epoch: int) -> str:
    """Why files for `epoch` from `source` must not be accepted ('' when they may)."""
    if h is None or h.phase is not Phase.IN_PREPARED or h.epoch != epoch or h.peer != source:
        held = f"epoch {h.epoch} ({h.phase})" if h is not None else "nothing"
        return f"not expecting a checkpoint at epoch {epoch} from {source}: this node holds {held}"
    return ""
