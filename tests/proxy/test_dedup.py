"""Replica splicing's memory, on a Server object in this process (its executor, its control
handler): identical storages of a job's sessions on one device are kept once, a write gives the
writer its own copy first, views keep aliasing, an all-reduce's result is written once, replicas
are judged at a collective every rank here waits at, and a save holds the shared storage once and
loads it shared and correct. The same with real server processes and programs:
test_dedup_processes.py.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from singularity.proxy.bootstrap._singularity_proxy import protocol
from singularity.proxy.server.collective_kinds import write_alike
from singularity.proxy.server.collectives import Exchange, Instance
from singularity.proxy.server.control import ControlHandler
from singularity.proxy.server.dedup import REPLICA_ROUNDS
from singularity.proxy.server.service import Server
from singularity.proxy.server.session import Session
from tests.helpers import wait_until

JOB = "job"
FLOATS = 4096
"""Elements of the test's tensors (16 KiB: above the size worth sharing)."""


@pytest.fixture
def server() -> Iterator[Server]:
    """A virtual device's server in this process (sessions dropped at the end)."""
    made = Server(0, 1 << 30, None)
    yield made
    for session in list(made.sessions.values()):
        made.drop(session)


def open_sessions(server: Server, ranks: int) -> list[Session]:
    """Sessions of ranks 0..ranks-1 of the test's job."""
    sessions = [Session(JOB, rank, os.getuid(), server.memory) for rank in range(ranks)]
    for session in sessions:
        server.add_session(session)
    return sessions


def run(server: Server, session: Session, ops: list[list[object]]) -> None:
    """Run operations as the session's process would send them; raise the first failure."""
    server.executor.run_ops(session, ops, 0, len(ops), [])
    session.raise_pending()


def save_job(server: Server, path: Path) -> None:
    """Save the test's job (its sessions parked) into a device-state file at `path`."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        ControlHandler(server).save(JOB, fd)
    finally:
        os.close(fd)


def load_job(server: Server, path: Path) -> None:
    """Load the test's job from the device-state file at `path` onto `server`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        ControlHandler(server).load(JOB, fd)
    finally:
        os.close(fd)


def handle(number: int) -> dict[str, int]:
    return {protocol.TAG_HANDLE: number}


def test_identical_storages_are_kept_once_and_copied_before_a_write(server: Server) -> None:
    """Same bytes under two ranks are held once; an operation writing through a view gives its
    session its own copy first (the other rank keeps its bytes, the view still aliases its base)."""
    first, second = open_sessions(server, 2)
    values = torch.arange(FLOATS, dtype=torch.float32)
    for session in (first, second):
        session.add(1, values.clone())
        session.add(2, session.tensors[1][10:20])
        session.add(3, torch.full((FLOATS,), float(session.rank)))  # differs per rank
    alone = server.memory.used
    server.dedup.share_job(JOB)
    assert server.memory.used == alone - FLOATS * 4
    assert second.tensors[1].data_ptr() == first.tensors[1].data_ptr()
    assert second.tensors[2].data_ptr() == first.tensors[2].data_ptr()
    assert second.tensors[3].data_ptr() != first.tensors[3].data_ptr()
    assert (first.held_bytes, second.held_bytes) == (2 * FLOATS * 4, 2 * FLOATS * 4)

    ops: list[list[object]] = [
        [protocol.OP_DEFINE, 1, "aten", "add_", "Tensor"],
        [protocol.OP_CALL, 1, 100, [handle(2), handle(2)], {}],  # the view doubles itself
    ]
    run(server, second, ops)
    assert torch.equal(first.tensors[1], values), "the other rank's bytes are untouched"
    doubled = values.clone()
    doubled[10:20] *= 2
    assert torch.equal(second.tensors[1], doubled), "the write reached the base through the view"
    assert second.tensors[2].untyped_storage()._cdata == second.tensors[1].untyped_storage()._cdata
    assert server.memory.used == alone


def test_an_in_place_update_of_a_whole_shared_storage_runs_apart_without_a_copy(server: Server) -> None:
    """An in-place pointwise operator on the whole of a shared storage (an optimizer's update of
    a parameter), or a copy into all of it, runs out of place into the writer's new storage:
    nothing is copied, the result has the in-place operator's bits, the other rank keeps its
    bytes and views follow the writer's."""
    first, second = open_sessions(server, 2)
    values = torch.randn(FLOATS, generator=torch.Generator().manual_seed(1))
    scale = torch.randn(FLOATS, generator=torch.Generator().manual_seed(2))
    for session in (first, second):
        session.add(1, values.clone())
        session.add(2, session.tensors[1][10:20])
        session.add(3, scale.clone())
        session.add(4, session.tensors[3][5:9])
        session.add(6, torch.linspace(0, 1, FLOATS))
        session.add(7, torch.zeros(FLOATS))
    server.dedup.share_job(JOB)
    alone = server.memory.used
    ops: list[list[object]] = [
        [protocol.OP_DEFINE, 1, "aten", "addcdiv_", "default"],
        [protocol.OP_CALL, 1, 100, [handle(1), handle(3), handle(1)], {"value": -0.25}],
    ]
    run(server, second, ops)
    expected = values.clone().addcdiv_(scale, values.clone(), value=-0.25)
    assert server.memory.copied_bytes == 0, "the shared bytes were copied before the write"
    assert torch.equal(first.tensors[1], values), "the other rank's bytes are untouched"
    assert torch.equal(second.tensors[1], expected)
    assert torch.equal(second.tensors[2], expected[10:20]), "the view follows its base"
    assert second.tensors[2].untyped_storage()._cdata == second.tensors[1].untyped_storage()._cdata
    assert server.memory.used == alone + FLOATS * 4

    run(
        server,
        first,
        [
            [protocol.OP_DEFINE, 4, "aten", "copy_", "default"],
            [protocol.OP_CALL, 4, 103, [handle(7), handle(3)], {}],
        ],
    )
    assert server.memory.copied_bytes == 0, "bytes about to be overwritten were copied"
    assert torch.equal(first.tensors[7], scale) and torch.equal(second.tensors[7], torch.zeros(FLOATS))

    ops = [  # only a part of a shared storage: copied first, as before
        [protocol.OP_DEFINE, 2, "aten", "mul_", "Scalar"],
        [protocol.OP_CALL, 2, 101, [handle(4), 2.0], {}],
    ]
    run(server, first, ops)
    assert server.memory.copied_bytes == FLOATS * 4
    assert torch.equal(first.tensors[3][5:9], scale[5:9] * 2)
    assert torch.equal(second.tensors[3], scale)

    second.add(5, torch.full((FLOATS,), 3.0, dtype=torch.float64))
    ops = [  # out of place it would be float64: it runs in place on a copy, as before
        [protocol.OP_DEFINE, 3, "aten", "mul_", "Tensor"],
        [protocol.OP_CALL, 3, 102, [handle(6), handle(5)], {}],
    ]
    run(server, second, ops)
    assert server.memory.copied_bytes == 2 * FLOATS * 4
    ramp = torch.linspace(0, 1, FLOATS)
    assert torch.equal(second.tensors[6], ramp.clone().mul_(torch.full((FLOATS,), 3.0, dtype=torch.float64)))
    assert second.tensors[6].dtype == torch.float32 and torch.equal(first.tensors[6], ramp)


def test_an_all_reduce_result_is_written_once_for_the_ranks_here(server: Server) -> None:
    """The same result for three ranks here (an all-reduce's): the first rank's tensor is written,
    the second's takes its storage (nothing copied or compared, held once, copy-on-write after),
    and a tensor that is only a part of its storage is written as before."""
    first, second, third = open_sessions(server, 3)
    for session in (first, second, third):
        session.add(1, torch.full((FLOATS,), float(session.rank)))  # each rank's own gradients
        session.add(2, session.tensors[1][:8])
        session.add(3, torch.zeros(2 * FLOATS))
    third.add(4, third.tensors[3][:FLOATS])  # a bucket that is a part of a larger storage
    members = (first, second, third)
    instance = Instance(
        JOB,
        "group",
        0,
        locals={s.rank: {"op": "sum", "factor": 1.0, "root": 0} for s in members},
        sessions={s.rank: s for s in members},
    )
    exchange = Exchange(server.collectives, instance, runner=None)  # type: ignore[arg-type]
    result = torch.linspace(0, 1, FLOATS)
    before = (server.memory.used, server.dedup.comparisons, server.memory.copied_bytes)
    with server.executor.lock:
        write_alike(exchange, [(0, first.tensors[1]), (1, second.tensors[1]), (2, third.tensors[4])], result)
    for tensor in (first.tensors[1], second.tensors[1], third.tensors[4]):
        assert torch.equal(tensor, result)
    assert torch.equal(second.tensors[2], result[:8]), "the view follows its base"
    assert second.tensors[1].untyped_storage()._cdata == first.tensors[1].untyped_storage()._cdata
    assert third.tensors[3].untyped_storage()._cdata != first.tensors[1].untyped_storage()._cdata
    assert torch.equal(third.tensors[3][FLOATS:], torch.zeros(FLOATS)), "the rest of its storage stays"
    assert server.memory.used == before[0] - FLOATS * 4
    assert (server.dedup.comparisons, server.memory.copied_bytes) == before[1:]

    ops: list[list[object]] = [
        [protocol.OP_DEFINE, 1, "aten", "add_", "Tensor"],
        [protocol.OP_CALL, 1, 100, [handle(2), handle(2)], {}],
    ]
    run(server, second, ops)
    assert torch.equal(first.tensors[1], result), "a write after it reaches only the writer"
    assert torch.equal(second.tensors[2], result[:8] * 2)


def test_a_rank_arriving_at_a_collective_leaves_out_what_the_collective_writes(server: Server) -> None:
    """A rank that reaches a collective shares its long-lived storages that match another rank's,
    but not those the collective is about to write: their bytes change (it compares them after)."""
    first, second = open_sessions(server, 2)
    for session in (first, second):
        session.add(1, torch.full((FLOATS,), 1.0))  # parameters
        session.add(2, torch.full((FLOATS,), 2.0))  # a bucket the collective writes, alike before it
    for session in (first, second):
        server.dedup.at_collective(session)  # the first round notes what each rank holds
    before = server.dedup.comparisons
    server.dedup.at_collective(first, [first.tensors[2]])

    def storage(session: Session, handle: int) -> int:
        return int(session.tensors[handle].untyped_storage()._cdata)

    assert storage(first, 1) == storage(second, 1)
    assert storage(first, 2) != storage(second, 2)
    assert server.dedup.comparisons == before + 1


def test_a_dropped_session_frees_only_when_nothing_runs_on_the_device(server: Server) -> None:
    """Dropping a rank (its process ended) frees storages it may share with the ranks still
    running: that waits for the device's lock, so it never interleaves with an operation."""
    first, second = open_sessions(server, 2)
    for session in (first, second):
        session.add(1, torch.zeros(FLOATS))
    server.dedup.share_job(JOB)
    used = server.memory.used
    done = threading.Event()

    def drop() -> None:
        server.drop(first)
        done.set()

    with server.executor.lock:  # an operation of `second` is running
        dropper = threading.Thread(target=drop)
        dropper.start()
        assert not done.wait(0.3), "the drop went on beside a running operation"
        assert (first.held_bytes, server.memory.is_shared(first.tensors[1].untyped_storage()._cdata)) == (
            FLOATS * 4,
            True,
        )
    dropper.join(10)
    assert done.is_set() and first.held_bytes == 0 and not first.tensors
    assert server.memory.used == used and server.memory.shared == 0


def test_a_dropped_session_lets_its_memory_go_on_a_thread_of_its_own(server: Server) -> None:
    """Dropping a session (a released job) counts its bytes off at once, and the tensors die on
    another thread: whoever waits for the release does not wait for the kernel to take the memory."""
    (session,) = open_sessions(server, 1)
    session.add(1, torch.zeros(FLOATS))
    died_on: list[str] = []
    weakref.finalize(session.tensors[1], lambda: died_on.append(threading.current_thread().name))
    server.drop(session)
    assert session.held_bytes == 0 and server.memory.used == 0
    wait_until(lambda: died_on, timeout=10)
    assert died_on == ["free-memory"]


def test_replicas_are_judged_where_every_rank_here_waits_at_one_collective(server: Server) -> None:
    """Two replicas whose counts of collectives are one apart (as after a restore that found one
    rank waiting at a collective): each step, the rank that steps first reaches its collective while
    the other still holds last step's parameters. Judged there, they would differ three rounds in a
    row and be called not replicas; judged where both wait at the same collective, they are."""
    first, second = open_sessions(server, 2)
    for session in (first, second):
        session.add(1, torch.zeros(FLOATS))
    server.dedup.at_collective(first)  # counted one collective more than `second`
    define = [protocol.OP_DEFINE, 1, "aten", "fill_", "Scalar"]
    verdicts = []
    for step in range(1, 3 * REPLICA_ROUNDS):
        for session in (second, first):  # `second` steps and reaches the collective first
            run(server, session, [define, [protocol.OP_CALL, 1, 100, [handle(1), float(step)], {}]])
            run(server, session, [[protocol.OP_FREE, [100]]])
            server.dedup.at_collective(session)
        server.dedup.at_round([first, second])
        verdicts.append(server.dedup.verdicts.get(JOB, ("unknown", ""))[0])
    assert "no" not in verdicts, verdicts
    assert verdicts[-1] == "yes", server.dedup.summary(JOB, share=False)


def mesh_verdicts(server: Server, weights: list[torch.Tensor], rounds: int) -> list[str]:
    """Four ranks of a 2 x 2 mesh on this device holding `weights`: each round, the collectives of
    its sub-groups (ranks 0-1 and 2-3, then 0-2 and 1-3), none of all four; the verdict after each."""
    ranks = open_sessions(server, 4)
    for session, weight in zip(ranks, weights, strict=True):
        session.add(1, weight.clone())
    verdicts = []
    for _ in range(rounds):
        for group in ((0, 1), (2, 3), (0, 2), (1, 3)):
            for rank in group:
                server.dedup.at_collective(ranks[rank])
            server.dedup.at_round([ranks[rank] for rank in group])
        verdicts.append(server.dedup.verdicts.get(JOB, ("unknown", ""))[0])
    return verdicts


def test_ranks_of_a_mesh_that_hold_different_shards_are_not_replicas(server: Server) -> None:
    """Tensor- and data-parallel ranks of a 2-D mesh (FSDP with TP) only ever meet at sub-group
    collectives; after a run of those they are judged there, and their shards differ: not replicas."""
    generator = torch.Generator().manual_seed(3)
    verdicts = mesh_verdicts(server, [torch.randn(FLOATS, generator=generator) for _ in range(4)], 6)
    assert verdicts[0] == "unknown" and verdicts[-1] == "no", verdicts
    assert "hold different parameters: not data-parallel replicas" in server.dedup.verdicts[JOB][1]


def test_ranks_of_a_mesh_that_replicate_their_shards_are_replicas(server: Server) -> None:
    """Ranks 0 and 2 hold one shard and 1 and 3 another (a replicated dimension, as in HSDP):
    judged at the same sub-group collectives, each rank's state is also another rank's."""
    generator = torch.Generator().manual_seed(3)
    first, second = (torch.randn(FLOATS, generator=generator) for _ in range(2))
    verdicts = mesh_verdicts(server, [first, second, first, second], 6)
    assert "no" not in verdicts and verdicts[-1] == "yes", verdicts


def test_a_rank_that_stepped_first_shares_once_the_others_catch_up(server: Server) -> None:
    """Three replicas: rank 2 steps and reaches its collective first (the others still hold last
    step's bytes: no match), then ranks 0 and 1 step to the same bytes and share with each other.
    At the next collective rank 2, unchanged itself, is compared again because the others changed,
    and the three hold one storage; judged round after round, they are replicas throughout."""
    ranks = open_sessions(server, 3)
    for session in ranks:
        session.add(1, torch.zeros(FLOATS))
    server.dedup.share_job(JOB)
    fill = [protocol.OP_DEFINE, 1, "aten", "fill_", "Scalar"]
    add = [protocol.OP_DEFINE, 2, "aten", "add_", "Scalar"]  # rank 2's step: same bytes, not squashed
    verdicts = []
    for step in range(2 * REPLICA_ROUNDS):
        run(
            server,
            ranks[2],
            [add, [protocol.OP_CALL, 2, 100, [handle(1), 1.0], {}], [protocol.OP_FREE, [100]]],
        )
        server.dedup.at_collective(ranks[2])
        for session in ranks[:2]:
            run(server, session, [fill, [protocol.OP_CALL, 1, 100, [handle(1), float(step + 1)], {}]])
            run(server, session, [[protocol.OP_FREE, [100]]])
        for session in ranks[:2]:
            server.dedup.at_collective(session)
        server.dedup.at_round(ranks)
        for _ in range(REPLICA_ROUNDS):  # the step's further collectives (DDP's buckets)
            for session in ranks:
                server.dedup.at_collective(session)
            server.dedup.at_round(ranks)
            verdicts.append(server.dedup.verdicts.get(JOB, ("unknown", ""))[0])
        pointers = {session.tensors[1].data_ptr() for session in ranks}
        assert step == 0 or len(pointers) == 1, f"step {step}: the ranks hold {len(pointers)} copies"
    assert "no" not in verdicts, verdicts


def test_a_save_holds_a_shared_storage_once_and_loads_it_shared(server: Server, tmp_path: Path) -> None:
    """A quiesced job whose ranks share storages saves them once; loaded on another device, the
    ranks share them again (the sharing figure, read before any step, says so: the state is
    restored, not measured anew), hold the same bytes, and a write still reaches only its own rank.
    Ranks never compared yet say their figures are not measured, rather than sharing nothing."""
    sessions = open_sessions(server, 3)
    generator = torch.Generator().manual_seed(5)
    weights = torch.randn(FLOATS, generator=generator)
    for session in sessions:
        session.add(1, weights.clone())
        session.add(2, torch.randn(FLOATS, generator=generator))
        session.parked = True
    fresh = server.dedup.summary(JOB, share=False)
    assert (fresh["measured"], fresh["shared_bytes"]) == (False, 0), fresh
    server.dedup.share_job(JOB)
    assert server.dedup.summary(JOB, share=False)["shared_bytes"] == FLOATS * 4
    path = tmp_path / "state"
    save_job(server, path)
    assert path.stat().st_size < 5 * FLOATS * 4, "the shared storage is written once"

    loaded_on = Server(1, 1 << 30, None)
    try:
        load_job(loaded_on, path)
        assert loaded_on.memory.used == server.memory.used == 4 * FLOATS * 4
        restored = loaded_on.dedup.summary(JOB, share=False)  # as a status read sees it, before any step
        assert (restored["measured"], restored["shared_bytes"]) == (True, FLOATS * 4), restored
        loaded = loaded_on.job_sessions(JOB)
        for mine, saved in zip(loaded, sessions, strict=True):
            for number in (1, 2):
                assert mine.tensors[number].view(torch.int32).equal(saved.tensors[number].view(torch.int32))
        assert len({s.tensors[1].data_ptr() for s in loaded}) == 1
        ops: list[list[object]] = [
            [protocol.OP_DEFINE, 1, "aten", "mul_", "Tensor"],
            [protocol.OP_CALL, 1, 100, [handle(1), handle(2)], {}],
        ]
        run(loaded_on, loaded[1], ops)
        assert torch.equal(loaded[0].tensors[1], weights) and torch.equal(loaded[2].tensors[1], weights)
        assert torch.equal(loaded[1].tensors[1], weights * sessions[1].tensors[2])
    finally:
        for session in loaded_on.job_sessions(JOB):
            loaded_on.drop(session)
