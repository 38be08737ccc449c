"""Collectives between real proxy servers and job processes, without the daemon.

The servers of a job's devices are linked pairwise as the daemon links them; the ranks are
started torchrun-style. What is checked: results do not depend on how ranks are spread over
devices, and a rank that dies makes the collectives waiting for it fail, never hang.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.proxy.conftest import (
    ProxyServer,
    communicate_all,
    direct_ranks,
    start_linked_servers,
    start_ranks,
    stop_server,
)


@pytest.fixture
def linked(tmp_path: Path) -> Iterator[dict[int, list[ProxyServer]]]:
    """Servers started on demand per device count (stopped at the end)."""
    started: dict[int, list[ProxyServer]] = {}
    yield started
    for servers in started.values():
        for server in servers:
            stop_server(server)


def run_on(
    linked: dict[int, list[ProxyServer]], tmp: Path, devices: int, ranks: int, args: Sequence[str]
) -> list[tuple[int, str, str]]:
    """Run a program's ranks on `devices` linked servers: (exit code, stdout, stderr) per rank."""
    folder = tmp / f"devices-{devices}-{len(linked)}"
    folder.mkdir()
    servers = linked[len(linked)] = start_linked_servers(folder, devices)
    processes = start_ranks(args, ranks, [s.socket for s in servers])
    outputs = communicate_all(processes, 600)
    return [(p.returncode, out, err) for p, (out, err) in zip(processes, outputs, strict=True)]


def stdout_of(results: list[tuple[int, str, str]]) -> list[str]:
    """Each rank's stdout, once every rank succeeded."""
    assert [code for code, _, _ in results] == [0] * len(results), [err[-2000:] for _, _, err in results]
    return [out for _, out, _ in results]


@pytest.mark.timeout(900)
def test_results_do_not_depend_on_how_ranks_are_spread(
    linked: dict[int, list[ProxyServer]], tmp_path: Path
) -> None:
    """4 ranks on 1, 2 and 4 devices: every collective gives the same bits."""
    raw = [stdout_of(run_on(linked, tmp_path, devices, 4, ["raw_collectives.py"])) for devices in (1, 2, 4)]
    assert raw[0] == raw[1] == raw[2]
    assert all(f"rank {r} done backend=nccl" in out for r, out in enumerate(raw[0]))


@pytest.mark.timeout(600)
def test_ddp_does_not_depend_on_how_ranks_are_spread(
    linked: dict[int, list[ProxyServer]], tmp_path: Path
) -> None:
    """4 DDP ranks (fp16 compression hook) on 1 device and on 4 devices train to the same bits."""
    ddp = ["ddp_train.py", "--steps", "4", "--hook", "fp16"]
    assert stdout_of(run_on(linked, tmp_path, 1, 4, ddp)) == stdout_of(run_on(linked, tmp_path, 4, 4, ddp))


def test_a_dead_rank_fails_the_collective_waiting_for_it(
    linked: dict[int, list[ProxyServer]], tmp_path: Path
) -> None:
    """Rank 1 dies at step 3: rank 0's next collective fails with the reason, it does not hang."""
    results = run_on(linked, tmp_path, 2, 2, ["ddp_train.py", "--steps", "1000", "--crash", "1:3"])
    (code0, _, err0), (code1, out1, _) = results
    assert code1 == 3 and "rank 1 crashes at step 3" in out1
    assert code0 == 1
    assert "proxy: rank 1 ended before it reached collective" in err0, err0[-3000:]


def test_a_collective_queued_by_a_rank_that_ended_still_completes(
    linked: dict[int, list[ProxyServer]], tmp_path: Path
) -> None:
    """Rank 1 exits right after queueing an all_reduce (nanoGPT's last step does): what it sent
    is still run, so rank 0 gets the sum instead of "rank 1 ended before it reached collective"."""
    for devices in (1, 2):
        outputs = stdout_of(run_on(linked, tmp_path, devices, 2, ["last_collective.py"]))
        assert outputs == ["rank 0 sum [3.0, 3.0, 3.0, 3.0]\n", ""], outputs


@pytest.mark.timeout(600)
def test_a_backend_per_device_type_uses_the_proxy_for_cuda(
    linked: dict[int, list[ProxyServer]], tmp_path: Path
) -> None:
    """init_process_group("cuda:nccl,cpu:gloo"): cuda tensors reduce through the proxies as with
    "nccl", bit for bit."""
    nccl = stdout_of(run_on(linked, tmp_path, 2, 2, ["raw_collectives.py", "--backend", "nccl"]))
    both = ["raw_collectives.py", "--backend", "cuda:nccl,cpu:gloo"]
    mixed = stdout_of(run_on(linked, tmp_path, 2, 2, both))

    def results(outputs: list[str]) -> list[list[str]]:
        return [[line for line in out.splitlines() if " done backend=" not in line] for out in outputs]

    assert results(mixed) == results(nccl) and all(results(nccl))


@pytest.mark.timeout(300)
def test_what_nccl_refuses_before_a_collective_is_refused(
    linked: dict[int, list[ProxyServer]], tmp_path: Path
) -> None:
    """Non-dense tensors NCCL takes as they are, bitwise reductions and averages of booleans are
    refused as NCCL's process group refuses them (they ran, and wrote views in another order than
    a GPU or gloo would); dense tensors, channels-last ones included, are carried out."""
    outputs = stdout_of(run_on(linked, tmp_path, 1, 2, ["nccl_refusals.py"]))
    for rank, out in enumerate(outputs):
        lines = out.splitlines()
        refused = [line for line in lines if ": " in line]
        assert len(refused) == 8 and all("Tensors must be contiguous" in line for line in refused[:6]), out
        assert refused[6] == f"rank {rank} all_reduce band ValueError: Cannot use ReduceOp.BAND with NCCL"
        assert refused[7].endswith("TypeError: Cannot use ReduceOp.AVG with boolean inputs")
    assert outputs[0].splitlines()[-1] == outputs[1].splitlines()[-1].replace("rank 1", "rank 0")
    assert "dense [100.0, 102.0, 104.0, 106.0, " in outputs[0]


def _figures(output: str) -> dict[str, float]:
    """sync_batchnorm.py's printed figures by what they are ("step 0 rank 1 loss" -> value)."""
    kinds = ("step ", "eval ", "rank ")
    lines = [line.rsplit(" ", 1) for line in output.splitlines() if line.startswith(kinds)]
    return {name: float(value) for name, value in lines}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [[], ["--channels-last"]], ids=["contiguous", "channels-last"])
def test_sync_batch_norm_trains_as_one_batch_norm_over_every_rank_s_batch(
    linked: dict[int, list[ProxyServer]], tmp_path: Path, layout: list[str]
) -> None:
    """SyncBatchNorm's kernels exist for CUDA only; on virtual devices the server runs its own
    (host_kernels.py). 2 DDP ranks train with it to the losses, running statistics and weights of
    one process training plain BatchNorm on both ranks' batches (up to rounding), and the same bits
    on 2 devices as spliced on 1."""
    program = ["sync_batchnorm.py", *layout]
    two = stdout_of(run_on(linked, tmp_path, 2, 2, program))
    assert stdout_of(run_on(linked, tmp_path, 1, 2, program)) == two
    (out,) = direct_ranks(program[0], [*program[1:], "--single", "2"], 1)
    expected, got = _figures(out), {**_figures(two[0]), **_figures(two[1])}
    assert len(expected) == 52 and set(got) == set(expected)
    far = {
        name: (value, got[name])
        for name, value in expected.items()
        if not math.isclose(value, got[name], rel_tol=1e-5, abs_tol=1e-6)
    }
    assert not far, far


@pytest.mark.timeout(900)
def test_point_to_point_messages_equal_a_direct_gloo_run(
    linked: dict[int, list[ProxyServer]], tmp_path: Path
) -> None:
    """A 4-stage pipeline (send/recv forward, batch_isend_irecv backward and both ways, a ring of
    isend then recv, object messages) on 4, 2 and 1 devices prints what it prints run directly
    with gloo, every rank; so does torch.distributed.pipelining's 1F1B schedule over 4 stages."""
    program = ["pipeline_train.py", "--steps", "5"]
    expected = direct_ranks(program[0], [*program[1:], "--device", "cpu"], 4)
    assert all(out.count(" step ") == 5 for out in expected) and "rank 0 object {'from': 3" in expected[0]
    for devices in (4, 2, 1):
        assert stdout_of(run_on(linked, tmp_path, devices, 4, program)) == expected, devices
    schedules = ["pipelining_schedule.py", "--schedule", "1f1b"]
    expected = direct_ranks(schedules[0], [*schedules[1:], "--device", "cpu"], 4)
    assert "losses" in expected[3], expected
    assert stdout_of(run_on(linked, tmp_path, 4, 4, schedules)) == expected
