"""An all-reduce whose members all run on one device folds into rank 0's tensor in place
(collective_kinds.py `_allreduce_here`), on a Server object in this process: the same bits as a
fold into a new tensor in rank order, for every reduction, with no result buffer made; members that
pass one storage twice take the general path."""

from __future__ import annotations

import pytest
import torch

from singularity.proxy.server import collective_kinds
from singularity.proxy.server.collective_kinds import allreduce
from singularity.proxy.server.collectives import Exchange, Instance
from singularity.proxy.server.service import Server
from singularity.proxy.server.session import Session
from tests.proxy.test_dedup import JOB, open_sessions, server

__all__ = ["server"]  # the fixture, shared with test_dedup.py

FLOATS = 50_000


def _run_allreduce(
    server: Server, sessions: list[Session], handles: list[int], op: str, factor: float
) -> None:
    """All-reduce the tensors under these handles of every session, as the collective's driver does."""
    instance = Instance(
        JOB,
        "group",
        0,
        members=[s.rank for s in sessions],
        placement=[0] * len(sessions),
        locals={
            s.rank: {"tensors": [s.tensors[h] for h in handles], "op": op, "factor": factor, "root": 0}
            for s in sessions
        },
        sessions={s.rank: s for s in sessions},
    )
    allreduce(Exchange(server.collectives, instance, runner=None))  # type: ignore[arg-type]


def _values(rank: int) -> torch.Tensor:
    return torch.randn(FLOATS, generator=torch.Generator().manual_seed(rank)) * (rank + 1)


@pytest.mark.parametrize("op", ["sum", "avg", "premul_sum", "max"])
def test_rank_zero_folds_the_others_into_itself_with_the_same_bits(
    server: Server, op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's tensor ends with ((x0 + x1) + x2) (or that reduction), bit for bit what a fold into
    a new tensor gives, without being written from one; every member holds it."""
    written: list[int] = []
    write = collective_kinds.write

    def noting(target: torch.Tensor, values: torch.Tensor) -> None:
        written.append(target.data_ptr())
        write(target, values)

    monkeypatch.setattr(collective_kinds, "write", noting)
    sessions = open_sessions(server, 3)
    for session in sessions:
        session.add(1, _values(session.rank))
    address = sessions[0].tensors[1].data_ptr()
    factor = 0.25
    parts = [_values(rank) for rank in range(3)]
    if op == "premul_sum":
        expected = parts[0] * factor
        for part in parts[1:]:
            expected.add_(part * factor)
    elif op == "max":
        expected = torch.maximum(torch.maximum(parts[0], parts[1]), parts[2])
    else:
        expected = (parts[0] + parts[1]) + parts[2]
        if op == "avg":
            expected.div_(3)
    _run_allreduce(server, sessions, [1], op, factor)
    assert sessions[0].tensors[1].data_ptr() == address and address not in written, "folded in place"
    for session in sessions:
        assert torch.equal(session.tensors[1].view(torch.int32), expected.view(torch.int32))


def test_a_member_passing_one_storage_twice_takes_the_general_path(server: Server) -> None:
    """Two tensors of a member over one storage: folding the first in place would change what the
    second reads, so the result is made apart and both come out as a fold of the originals."""
    sessions = open_sessions(server, 2)
    for session in sessions:
        session.add(1, _values(session.rank))
        session.add(2, session.tensors[1])
    originals = [_values(rank) for rank in range(2)]
    _run_allreduce(server, sessions, [1, 2], "sum", 1.0)
    expected = originals[0] + originals[1]
    assert torch.equal(sessions[0].tensors[1], expected)
    assert torch.equal(sessions[1].tensors[1], expected)
