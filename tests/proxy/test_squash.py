"""Operation squashing: an operation every spliced replica runs is run once on the device.

On a Server object in this process: three ranks of a job hold the same weights (shared by the
dedup); ranks 0 and 1 hold equal gradients in storages of their own, rank 2 another gradient.
Rank 0 updates its weights; rank 1's update is not run but reuses rank 0's result (its gradient
found equal by comparing bytes, then its weights moved onto rank 0's), with the same answer
to the job; rank 2, whose update differs, computes its own.
"""

from __future__ import annotations

import torch

from singularity.proxy.bootstrap._singularity_proxy import protocol
from singularity.proxy.server.service import Server
from singularity.proxy.server.session import Session
from tests.proxy.test_dedup import FLOATS, JOB, handle, open_sessions, run, server

__all__ = ["server"]  # the fixture: a virtual device's server in this process


def storage_of(session: Session, number: int) -> int:
    return int(session.tensors[number].untyped_storage()._cdata)


def update(server: Server, session: Session) -> list[object]:
    """weights -= 0.1 * grads (in place, planned as the optimizer's ops are), then weights * grads
    (a new tensor under handle 100); the answer's output template of the second."""
    ops: list[list[object]] = [
        [protocol.OP_DEFINE, 1, "aten", "add_", "Tensor"],
        [protocol.OP_DEFINE, 2, "aten", "mul", "Tensor"],
        [protocol.OP_PLAN, 1, 1, [{protocol.TAG_SLOT: protocol.SLOT_TENSOR}] * 2, {"alpha": -0.1}],
        [protocol.OP_RUN, 1, 50, [1, 2]],
    ]
    run(server, session, ops)
    template = server.executor.answer(session, [protocol.REQ_CALL, 2, 100, [handle(1), handle(2)], {}], [])
    session.raise_pending()
    return list(template)


def test_an_update_that_replicas_run_alike_runs_once(server: Server) -> None:
    ranks = open_sessions(server, 3)
    weights = torch.arange(FLOATS, dtype=torch.float32)
    for session in ranks:
        session.add(1, weights.clone())
    server.dedup.share_job(JOB)
    assert len({storage_of(s, 1) for s in ranks}) == 1, "the weights are held once"
    grads = [torch.full((FLOATS,), 0.5), torch.full((FLOATS,), 0.5), torch.full((FLOATS,), 0.25)]
    for session, grad in zip(ranks, grads, strict=True):
        session.add(2, grad)  # each rank's own storage, rank 0's and rank 1's bytes equal

    templates = [update(server, session) for session in ranks]

    for session, grad in zip(ranks, grads, strict=True):
        expected = weights - 0.1 * grad
        assert torch.equal(session.tensors[1], expected)
        assert torch.equal(session.tensors[100], expected * grad)
    first, second, third = ranks
    assert server.squash.squashed == 2, server.squash.figures()
    assert server.squash.near_hits == 1, "rank 1's gradient was found equal to rank 0's"
    for number in (1, 2, 100):
        assert storage_of(second, number) == storage_of(first, number), number
        assert storage_of(third, number) != storage_of(first, number), number
    assert templates[0] == templates[1] == templates[2], "the job gets the answer it gets from a run"
    assert server.memory.used == 3 * FLOATS * 4 + 3 * FLOATS * 4, "ranks 0 and 1 hold one of each"


def test_a_lone_rank_keeps_no_memo(server: Server) -> None:
    (alone,) = open_sessions(server, 1)
    alone.add(1, torch.ones(FLOATS))
    alone.add(2, torch.ones(FLOATS))
    update(server, alone)
    assert server.squash.memo.entries == {} and server.memory.values == {}
    assert torch.equal(alone.tensors[100], torch.full((FLOATS,), 0.9))


def test_a_copy_over_a_whole_storage_is_squashed_and_over_part_of_one_is_not(server: Server) -> None:
    """copy_ into a tensor that is all of its storage does not depend on what it held: squashed
    whatever the destinations held; into half of a storage, the other half differs: run."""
    first, second = open_sessions(server, 2)
    source = torch.arange(FLOATS, dtype=torch.float32)
    for session in (first, second):
        session.add(1, source.clone())
        session.add(2, torch.full((FLOATS,), float(session.rank)))  # whole-storage destination
        session.add(3, torch.full((2 * FLOATS,), float(session.rank)))
        session.add(4, session.tensors[3][:FLOATS])  # half of handle 3's storage
    server.dedup.share_job(JOB)
    assert storage_of(first, 1) == storage_of(second, 1)
    ops: list[list[object]] = [
        [protocol.OP_DEFINE, 1, "aten", "copy_", "default"],
        [protocol.OP_CALL, 1, 50, [handle(2), handle(1)], {}],
        [protocol.OP_CALL, 1, 50, [handle(4), handle(1)], {}],
    ]
    for session in (first, second):
        run(server, session, ops)
    assert server.squash.squashed == 1, server.squash.figures()
    assert storage_of(first, 2) == storage_of(second, 2)
    assert storage_of(first, 3) != storage_of(second, 3)
    for session in (first, second):
        assert torch.equal(session.tensors[2], source)
        assert torch.equal(session.tensors[3][:FLOATS], source)
        assert torch.equal(session.tensors[3][FLOATS:], torch.full((FLOATS,), float(session.rank)))


def test_what_a_replica_made_and_freed_is_kept_for_the_others_until_they_ran_it(server: Server) -> None:
    """Rank 0 computes weights * 2 and frees the result before rank 1 computes the same (a
    temporary of an optimizer step, freed as the program drops it): the memo keeps the storage
    (counted against the capacity, not as held) and rank 1's call is squashed onto it; once rank 1
    frees its result too, nothing of it is left on the device. A product rank 0 made again is kept
    again, and goes when an allocation needs its room."""
    first, second = open_sessions(server, 2)
    for session in (first, second):
        session.add(1, torch.arange(FLOATS, dtype=torch.float32))
    server.dedup.share_job(JOB)
    shared = server.memory.used
    ops: list[list[object]] = [
        [protocol.OP_DEFINE, 1, "aten", "mul", "Tensor"],
        [protocol.OP_CALL, 1, 100, [handle(1), 2.0], {}],
    ]
    server.squash.useful.add(id(torch.ops.aten.mul.Tensor))  # as after one squashed call of it
    run(server, first, [*ops, [protocol.OP_FREE, [100]]])
    memory = server.memory
    assert (memory.used, memory.kept_bytes) == (shared + FLOATS * 4, FLOATS * 4), "kept for rank 1"
    run(server, second, ops)
    assert server.squash.squashed == 1, server.squash.figures()
    assert torch.equal(second.tensors[100], torch.arange(FLOATS, dtype=torch.float32) * 2)
    assert (memory.used, memory.kept_bytes) == (shared + FLOATS * 4, 0)
    run(server, second, [[protocol.OP_FREE, [100]]])
    assert memory.used == shared and not memory.kept

    run(server, first, [[protocol.OP_CALL, 1, 100, [handle(1), 3.0], {}], [protocol.OP_FREE, [100]]])
    assert memory.kept_bytes == FLOATS * 4
    memory.capacity = memory.used
    assert memory.room_for(FLOATS * 4), "the kept product goes to make room"
    assert memory.used == shared and not memory.kept

    run(server, first, [[protocol.OP_CALL, 1, 100, [handle(1), 4.0], {}], [protocol.OP_FREE, [100]]])
    assert memory.kept_bytes == FLOATS * 4
    for session in (first, second):
        server.drop(session)
    assert (memory.used, memory.kept) == (0, {}), "a job that left keeps nothing here"


def test_a_chain_goes_on_squashing_after_its_first_link_was_kept(server: Server) -> None:
    """Rank 0 computes weights * 2, divides that by 4 and frees the product (Adam's `sqrt`, then
    its division, as the step drops the temporary). Rank 1's product is squashed onto the kept
    one, which keeps its value id as rank 1 takes it, so rank 1's division is squashed too."""
    first, second = open_sessions(server, 2)
    for session in (first, second):
        session.add(1, torch.arange(FLOATS, dtype=torch.float32))
    server.dedup.share_job(JOB)
    server.squash.useful.add(id(torch.ops.aten.mul.Tensor))  # as after one squashed call of it
    define = [
        [protocol.OP_DEFINE, 1, "aten", "mul", "Tensor"],
        [protocol.OP_DEFINE, 2, "aten", "div", "Tensor"],
    ]
    chain: list[list[object]] = [
        [protocol.OP_CALL, 1, 100, [handle(1), 2.0], {}],
        [protocol.OP_CALL, 2, 101, [handle(100), 4.0], {}],
    ]
    run(server, first, [*define, *chain, [protocol.OP_FREE, [100]]])
    run(server, second, [*define, *chain])
    assert server.squash.squashed == 2, server.squash.figures()
    assert second.tensors[101].data_ptr() == first.tensors[101].data_ptr()
    assert torch.equal(second.tensors[101], torch.arange(FLOATS, dtype=torch.float32) / 2)
