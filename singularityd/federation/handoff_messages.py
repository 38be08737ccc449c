"""The hand-off machine's vocabulary: steps sent between daemons, stimuli it takes, actions it emits.

Data only; the rules are in `handoff`, which re-exports all of these.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Step(enum.StrEnum):
    """The requests a source sends to a target (singularity.peer.v1.HandoffStep)."""

    PREPARE = "PREPARE"
    RESTORE = "RESTORE"
    COMMIT = "COMMIT"
    ABORT = "ABORT"


# Stimuli from this daemon (source side).


@dataclass(frozen=True)
class MoveRequested:
    """Move the job to `target` (a user's `sing migrate`, a drain, placement)."""

    target: str


@dataclass(frozen=True)
class StepAnswered:
    """The target answered a request we sent."""

    step: Step
    epoch: int
    ok: bool
    reason: str = ""
    discarded: bool = False
    target_epoch: int = 0


@dataclass(frozen=True)
class StepFailed:
    """A request we sent got no answer (link down, peer down, timeout): its outcome is unknown."""

    step: Step
    epoch: int
    error: str


@dataclass(frozen=True)
class CheckpointReady:
    """The job is stopped and its final checkpoint for the move is complete."""

    epoch: int


@dataclass(frozen=True)
class TransferDone:
    """The target verified the whole checkpoint against our manifest."""

    epoch: int


@dataclass(frozen=True)
class MoveWorkFailed:
    """Stopping the job or sending its checkpoint failed."""

    epoch: int
    error: str


@dataclass(frozen=True)
class Tick:
    """Time passed: check deadlines and resend what must be resent."""


@dataclass(frozen=True)
class Recovered:
    """The daemon started again; decide what its records left unfinished."""


# Stimuli from a peer (target side); `source` is the node named by its certificate.


@dataclass(frozen=True)
class PrepareReceived:
    """The source asks us to take the job at `epoch`; `problem` is why we cannot host it ('' if we can).

    `hold_s` is the longest the source lets us hold the job without its commit (0: our own limit).
    """

    source: str
    epoch: int
    problem: str = ""
    hold_s: float = 0.0


@dataclass(frozen=True)
class RestoreReceived:
    """The source sent the whole checkpoint and asks us to restore the job frozen."""

    source: str
    epoch: int


@dataclass(frozen=True)
class RestoreFinished:
    """Our restore of the job (kept frozen) finished; `error` when it failed."""

    epoch: int
    error: str = ""


@dataclass(frozen=True)
class CommitReceived:
    """The source recorded the commit: the job is ours at `epoch`."""

    source: str
    epoch: int


@dataclass(frozen=True)
class AbortReceived:
    """The source recorded an abort: drop what we hold for `epoch`."""

    source: str
    epoch: int


Stimulus = (
    MoveRequested
    | StepAnswered
    | StepFailed
    | CheckpointReady
    | TransferDone
    | MoveWorkFailed
    | Tick
    | Recovered
    | PrepareReceived
    | RestoreReceived
    | RestoreFinished
    | CommitReceived
    | AbortReceived
)


# Actions for the daemon.


@dataclass(frozen=True)
class Send:
    """Send `step` for `epoch` to `peer`; feed back StepAnswered or StepFailed."""

    step: Step
    peer: str
    epoch: int


@dataclass(frozen=True)
class StopForMove:
    """Stop the job with a final checkpoint (after any pre-copy); feed back CheckpointReady/MoveWorkFailed."""

    epoch: int


@dataclass(frozen=True)
class SendCheckpoint:
    """Transfer the checkpoint to `peer`; feed back TransferDone or MoveWorkFailed."""

    peer: str
    epoch: int


@dataclass(frozen=True)
class ResumeHere:
    """If the job is stopped for a move, let it run here again; otherwise (running, held) nothing."""


@dataclass(frozen=True)
class DropLocalCopy:
    """The job lives elsewhere now: delete its checkpoint here and mark it moved."""

    peer: str


@dataclass(frozen=True)
class RestoreFrozen:
    """Restore the checkpoint received for `epoch` with its processes stopped; feed back RestoreFinished."""

    epoch: int


@dataclass(frozen=True)
class ReleaseFrozen:
    """The job is ours: let the processes restored for `epoch` run (nothing if they already do)."""

    epoch: int


@dataclass(frozen=True)
class DiscardIncoming:
    """Kill anything restored for `epoch` and delete the files received for it."""

    epoch: int


@dataclass(frozen=True)
class Reply:
    """Answer the peer's request for (`step`, `epoch`)."""

    step: Step
    epoch: int
    ok: bool
    reason: str = ""
    discarded: bool = False
    recorded_epoch: int = 0


@dataclass(frozen=True)
class Note:
    """Record an event in the job's log."""

    text: str


@dataclass(frozen=True)
class MoveFinished:
    """Tell whoever asked for the move how it ended."""

    ok: bool
    detail: str


Action = (
    Send
    | StopForMove
    | SendCheckpoint
    | ResumeHere
    | DropLocalCopy
    | RestoreFrozen
    | ReleaseFrozen
    | DiscardIncoming
    | Reply
    | Note
    | MoveFinished
)
