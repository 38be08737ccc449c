"""Replica splicing's memory: ranks of a job on one device keep identical storages once.

First on a Server object in this process (its executor, its control handler): identical storages
of two sessions are kept once, a write gives the writer its own copy first, views keep aliasing,
and a save holds the shared storage once and loads it shared and correct. Then with real server
processes and torch programs: 4 DDP ranks spliced on one device train to the bits of 4 devices,
using at most 1.5x the device memory of one rank alone after the step (their updates squashed,
squash.py, the peak bounded too), and are judged replicas; ranks with different weights are
judged not replicas, with the reason, and compute their own updates.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from singularity.proxy.bootstrap._singularity_proxy import protocol
from singularity.proxy.control import ProxyControl, splice_refusal
from singularity.proxy.server.collective_kinds import write_alike
from singularity.proxy.server.collectives import Exchange, Instance
from singularity.proxy.server.control import ControlHandler
from singularity.proxy.server.dedup import REPLICA_ROUNDS
from singularity.proxy.server.service import Server
from singularity.proxy.server.session import Session
from tests.conftest import requires_root
from tests.helpers import Daemon, preempt_while_training, running_daemon, wait_until
from tests.proxy.conftest import PYTHON, ProxyServer, start_linked_servers, start_ranks, stop_server
from tests.test_collectives import JOB_OPTIONS, printed, rank_logs, succeeded

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


# -- real servers, real programs ----------------------------------------------------------------------
@pytest.fixture
def started() -> Iterator[list[ProxyServer]]:
    """Servers the test starts (stopped at the end)."""
    servers: list[ProxyServer] = []
    yield servers
    for server in servers:
        stop_server(server)


class Held:
    """A job's ranks run up to the hold after their last step; then the test lets them end."""

    def __init__(self, folder: Path, servers: list[ProxyServer], ranks: int, args: Sequence[str]) -> None:
        folder.mkdir()
        self.folder = folder
        self.servers = servers
        self.release = folder / "release"
        ready = str(folder / "ready-")
        command = ["splice_train.py", *args, "--hold", str(self.release), "--ready", ready]
        self.processes = start_ranks(command, ranks, [s.socket for s in servers])
        self.ready = [Path(f"{ready}{rank}") for rank in range(ranks)]

    def wait_trained(self) -> None:
        """Wait until every rank is past its last step and the barrier after it."""

        def trained() -> bool:
            failed = [p for p in self.processes if p.poll() is not None]
            assert not failed, [p.communicate()[1][-3000:] for p in failed]
            return all(path.exists() for path in self.ready)

        wait_until(trained, timeout=600, interval=0.2)

    def finish(self) -> list[str]:
        """Let the ranks end; each one's stdout."""
        self.release.touch()
        outputs = [p.communicate(timeout=600) for p in self.processes]
        assert [p.returncode for p in self.processes] == [0] * len(self.processes), [
            err[-3000:] for _, err in outputs
        ]
        return [out for out, _ in outputs]


def held_job(
    started: list[ProxyServer],
    tmp: Path,
    devices: int,
    ranks: int,
    args: Sequence[str],
    options: Sequence[str] = (),
) -> Held:
    """Start a job of `ranks` ranks on `devices` linked servers (with these server options) and
    wait until it is trained."""
    where = tmp / f"servers-{len(started)}"
    where.mkdir()
    servers = start_linked_servers(where, devices, options=options)
    job = Held(tmp / f"job-{len(started)}", servers, ranks, args)
    started.extend(servers)
    job.wait_trained()
    return job


def server_status(server: ProxyServer) -> dict[str, Any]:
    """The server's status (its memory figures among them)."""
    with ProxyControl(server.control) as control:
        return dict(control.status())


def allocated(server: ProxyServer) -> int:
    """The server's own count of its live storage bytes."""
    return int(server_status(server)["allocated"])


def peak(server: ProxyServer) -> int:
    """The most live storage bytes the server held at once."""
    return int(server_status(server)["peak"])


def replicas(server: ProxyServer) -> dict[str, Any]:
    with ProxyControl(server.control) as control:
        return control.replicas(JOB)


MODEL = ["--width", "256", "--layers", "4", "--steps", "5"]
"""Parameters and Adam state of about 3 MiB against a few KiB of activations."""
PEAK_RATIO = 1.6
"""The most 4 spliced ranks hold at once against 1 rank alone. One rank alone peaks at about 5 P
(P: the parameters' bytes; parameters, gradients, DDP bucket, Adam's two states). Spliced, the
ranks take turns up to their collectives and wait there with what they alone hold in host
memory, and they update what they share a few operations apart (pace.py): 3 P shared plus about
one rank's own gradients and bucket, 1.32x-1.41x measured on a quiet machine (2.2x-2.6x before
the turns). The room above the issue's 1.5x is for a loaded machine."""
TURN_GRACE = ["--turn-grace", "0.05"]
"""The server option the spliced run takes: with the default grace (1 ms), a rank whose process is
off the CPU for longer loses its turn, and two ranks hold their gradients at once; on a loaded
machine (the suite's workers, or two busy loops beside this test on 2 cores) the peak was then
1.61x-1.92x. The test is of what the turns hold, so its ranks keep their turns through such
pauses; bench_splice.py measures the default."""


@pytest.mark.timeout(900)
def test_four_spliced_replicas_train_like_four_devices_in_one_model_of_memory(
    started: list[ProxyServer], tmp_path: Path
) -> None:
    """4 DDP ranks on 1 device print what they print on 4 devices, bit for bit; the device holds at
    most 1.5x what 1 rank alone holds after the step, and at most PEAK_RATIO during it, their
    updates squashed (run once) and their waits in host memory; the server judges the ranks
    data-parallel replicas."""
    alone = held_job(started, tmp_path, 1, 1, MODEL)
    alone_bytes = allocated(alone.servers[0])
    alone_peak = peak(alone.servers[0])
    assert replicas(alone.servers[0])["replicas"] == "unknown"
    alone.finish()

    spliced = held_job(started, tmp_path, 1, 4, MODEL, TURN_GRACE)
    spliced_bytes = allocated(spliced.servers[0])  # as the collectives left it, before any request
    spliced_peak = peak(spliced.servers[0])
    swapped = server_status(spliced.servers[0])["swapped_total"]
    summary = replicas(spliced.servers[0])
    spliced_out = spliced.finish()

    assert spliced_bytes <= 1.5 * alone_bytes, (spliced_bytes, alone_bytes, summary)
    assert summary["replicas"] == "yes", summary
    assert summary["device_bytes"] <= 1.5 * alone_bytes, summary
    assert splice_refusal([summary]) == ""
    assert summary["squashed"] > 0, summary
    assert spliced_peak <= PEAK_RATIO * alone_peak, (spliced_peak, alone_peak, summary)
    assert swapped > 0, "the waiting ranks' storages were moved to host memory"

    side_by_side = held_job(started, tmp_path, 1, 4, MODEL, ["--no-splice-lean"])
    side_by_side_peak = peak(side_by_side.servers[0])
    assert server_status(side_by_side.servers[0])["swapped_total"] == 0
    assert side_by_side.finish() == spliced_out
    assert spliced_peak < side_by_side_peak, (spliced_peak, side_by_side_peak, "splice_lean false")

    spread = held_job(started, tmp_path, 4, 4, MODEL)
    assert all(replicas(s)["replicas"] == "unknown" for s in spread.servers), "one rank per device"
    assert spliced_out == spread.finish()
    assert all(f"rank {r} final " in out for r, out in enumerate(spliced_out))


@pytest.mark.timeout(600)
def test_ranks_with_different_weights_are_not_replicas(started: list[ProxyServer], tmp_path: Path) -> None:
    """2 ranks that train their own weights on one device: the server says they are not replicas,
    naming them, and the daemon's check refuses splicing with that reason. Each computes its own
    updates (nothing squashed) and prints what it prints on a device of its own."""
    job = held_job(started, tmp_path, 1, 2, [*MODEL, "--different"])
    summary = replicas(job.servers[0])
    spliced_out = job.finish()
    assert (summary["squashed"], summary["near_hits"]) == (0, 0), summary
    spread = held_job(started, tmp_path, 2, 2, [*MODEL, "--different"])
    assert spliced_out == spread.finish()
    assert summary["replicas"] == "no", summary
    reason = str(summary["reason"])
    assert reason.startswith("ranks 0 and 1 hold different parameters: not data-parallel replicas"), reason
    assert splice_refusal([summary]) == reason


def device_control(daemon: Daemon, job: int) -> Path:
    """The daemon's control socket of the job's server on its one device."""
    found = sorted(daemon.state_dir.glob(f"proxy/control/job-{job}-dev-*.sock"))
    assert len(found) == 1, found
    return found[0]


def shared_now(daemon: Daemon, job: int) -> int:
    """Bytes the job's ranks share on its device now (what they hold alike shared first)."""
    with ProxyControl(device_control(daemon, job)) as control:
        return int(control.replicas(str(job))["shared_bytes"])


@requires_root
@pytest.mark.timeout(1800)
def test_a_spliced_job_preempted_and_resumed_is_exact(daemon_root: Path) -> None:
    """4 ranks spliced on 1 device (through the daemon, --gpus 1), preempted and resumed 3 times
    (the quiesce shares what the replicas hold alike, the save holds it once): every rank prints
    what an uninterrupted run on 4 devices prints."""
    total, ranks = 30, 4
    args = [*MODEL[:-1], str(total), "--sleep", "0.05"]
    options = [*JOB_OPTIONS, "--ranks", str(ranks)]
    release = daemon_root / "release"
    with running_daemon(daemon_root, virtual_devices=ranks) as daemon:
        uninterrupted = daemon.submit(PYTHON, "splice_train.py", *args, options=[*options, "--gpus", "4"])
        expected = printed(succeeded(daemon, uninterrupted, ranks))
        job = daemon.submit(
            PYTHON, "splice_train.py", *args, "--hold", str(release), options=[*options, "--gpus", "1"]
        )
        daemon.wait_state(job, "RUNNING")

        def restored_server_answers() -> None:
            """The restored server answers for the job."""
            assert shared_now(daemon, job) >= 0

        preempt_while_training(daemon, job, ranks, total, 3, wait_timeout=600, after=restored_server_answers)
        release.touch()
        assert daemon.sing("wait", str(job), timeout=600).code == 0, rank_logs(daemon, job, ranks)
        assert printed(rank_logs(daemon, job, ranks)) == expected
        reasons = [e["reason"] for e in daemon.job(job)["events"]]
        assert sum(r.startswith("restored from checkpoint") for r in reasons) == 3
