"""What the federation reports to the API: plain data, so the API layer needs none of its machinery."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from singularityd.federation.membership import PeerRow
from singularityd.federation.v1 import peer_pb2 as pb
from singularityd.store import JobRecord


@dataclass(frozen=True)
class MoveFacts:
    """How far the move of a job away from here has come (`sing show`, the `sing migrate` bar)."""

    peer: str
    phase: str
    moved: int = 0
    total: int = 0
    sent: int = 0


@dataclass(frozen=True)
class JoinInfo:
    """What a node joining this lab needs (`sing cluster init` and `sing cluster token` print it)."""

    node_name: str
    node_number: int
    token: str
    ca_fingerprint: str
    join_address: str
    token_expires_at: float


@dataclass(frozen=True)
class MoveReport:
    """One step of a move as `sing migrate` and `sing drain` show it; `done` on the last one."""

    job_id: int
    peer: str
    phase: str
    moved: int = 0
    total: int = 0
    done: bool = False
    ok: bool = False
    detail: str = ""


@dataclass(frozen=True)
class ClusterJobs:
    """The jobs of every node that answered: this node's records, the peers' descriptions."""

    local: list[JobRecord]
    remote: list[tuple[str, pb.PeerJob]]
    unreachable: list[str]


@dataclass(frozen=True)
class PeersView:
    """`sing peers`: this node's name and number ('' and 0 outside a lab), draining, its peers."""

    node: str
    number: int
    draining: bool
    peers: list[PeerRow]


def listing_fields(job: JobRecord) -> dict[str, Any]:
    """The fields a listing shows of a stored job, named as in singularity.v1.Job (and PeerJob)."""
    return {
        "id": job.id,
        "name": job.spec.name,
        "user": job.spec.user,
        "uid": job.spec.uid,
        "state": job.state.value,
        "reason": job.reason,
        "pending_reason": job.pending_reason if job.state.is_queued else "",
        "priority": job.spec.priority,
        "tier": job.spec.tier,
        "gpus": job.spec.gpus,
        "ranks": job.spec.ranks,
        "devices": list(job.devices),
        "command": list(job.spec.command),
        "submitted_at": job.submitted_at,
        "started_at": job.started_at or 0.0,
        "ended_at": job.ended_at or 0.0,
        "cwd": job.spec.cwd,
        "attempt": job.attempt,
    }
