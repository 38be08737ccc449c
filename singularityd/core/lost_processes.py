"""What a RUNNING job whose processes are gone becomes after a daemon restart: pure, no I/O.

A dump that stops a job (a preemption, a suspension, a resize, a move) kills its processes once
its images are complete. The job's new state is stored only after the daemon hears of it, so a
daemon killed in between comes back to a RUNNING job with no processes and a complete
checkpoint. The purpose of that dump is kept in its manifest (`StopPurpose`, written before the
dump): `after_lost_processes` turns such a checkpoint, taken during the job's current run, into
the outcome the daemon missed (`MissedStop`: the checkpoint under way, and that it completed),
and anything else into ProcessesLost. A move's dump is left to the hand-off records, which alone
know where the job runs.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from singularityd.core.actions import TakeCheckpoint
from singularityd.core.stimuli import Checkpointed, ProcessesLost


class StopKind(enum.StrEnum):
    """Why a dump stopped the job: what the job becomes once it is recorded."""

    PREEMPT = "preempt"
    SUSPEND = "suspend"
    RESIZE = "resize"
    MOVE = "move"


@dataclass(frozen=True)
class StopPurpose:
    """The purpose of a dump that stops the job, as its manifest keeps it."""

    kind: StopKind
    reason: str
    """What the checkpoint's event begins with (TakeCheckpoint.reason)."""
    gpus: int = 0
    """For a resize: the number of devices the job is restored on."""
    for_scheduler: bool = False

    @classmethod
    def of(cls, take: TakeCheckpoint) -> StopPurpose | None:
        """The purpose of a checkpoint the state machine asked for (None: it leaves the job running)."""
        if not take.stop:
            return None
        if take.for_move:
            kind = StopKind.MOVE
        elif take.hold:
            kind = StopKind.SUSPEND
        elif take.gpus:
            kind = StopKind.RESIZE
        else:
            kind = StopKind.PREEMPT
        return cls(kind, take.reason, take.gpus, take.for_scheduler)

    def as_dict(self) -> dict[str, Any]:
        """The JSON form kept in the checkpoint's intent and manifest."""
        return {
            "kind": self.kind.value,
            "reason": self.reason,
            "gpus": self.gpus,
            "for_scheduler": self.for_scheduler,
        }

    @classmethod
    def from_dict(cls, raw: object) -> StopPurpose | None:
        """The purpose a manifest records (None when it records none, or one this version does not know)."""
        if not isinstance(raw, Mapping):
            return None
        try:
            kind = StopKind(str(raw.get("kind")))
        except ValueError:
            return None
        gpus = raw.get("gpus")
        return cls(
            kind,
            str(raw.get("reason") or "stopped"),
            gpus if isinstance(gpus, int) and gpus > 0 else 0,
            bool(raw.get("for_scheduler")),
        )

    def take(self) -> TakeCheckpoint:
        """The checkpoint the state machine had under way for this purpose."""
        return TakeCheckpoint(
            True,
            hold=self.kind is StopKind.SUSPEND,
            reason=self.reason,
            for_scheduler=self.for_scheduler,
            for_move=self.kind is StopKind.MOVE,
            gpus=self.gpus if self.kind is StopKind.RESIZE else 0,
        )


@dataclass(frozen=True)
class NewestCheckpoint:
    """The job's newest complete checkpoint: its number, when it was complete, what it was for."""

    seq: int
    created_at: float
    purpose: StopPurpose | None


@dataclass(frozen=True)
class MissedStop:
    """A stopping dump completed but unrecorded: put `take` back as the job's activity and feed
    `outcome`, as if the daemon had lived to hear of it (a resize restores on `gpus` devices)."""

    take: TakeCheckpoint
    outcome: Checkpointed
    gpus: int = 0


def after_lost_processes(
    newest: NewestCheckpoint | None, run_began_at: float | None, detail: str, cancel_requested: bool = False
) -> MissedStop | ProcessesLost:
    """What a RUNNING job whose processes ended without an exit status while the daemon was down
    becomes: the stop its newest checkpoint was taken for, when that checkpoint stopped the job
    during its current run (begun at `run_began_at`) and was not a move; else ProcessesLost (also
    when a cancel was asked meanwhile: the job ends cancelled)."""
    if newest is None or newest.purpose is None or run_began_at is None or cancel_requested:
        return ProcessesLost(detail)
    if newest.purpose.kind is StopKind.MOVE or newest.created_at < run_began_at:
        return ProcessesLost(detail)
    summary = (
        f"checkpoint {newest.seq} (complete on disk when the daemon stopped, before it recorded "
        "the job stopped; recorded at restart)"
    )
    purpose = newest.purpose
    return MissedStop(
        purpose.take(), Checkpointed(summary), purpose.gpus if purpose.kind is StopKind.RESIZE else 0
    )
