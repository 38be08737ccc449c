"""Replica splicing on one device: its memory, its step time, the dedup's cost.

Run: .venv/bin/python bench/bench_splice.py [--quick]   (one intra-op thread everywhere; virtual
devices). Measured side by side in one run:
- device memory of 4 DDP ranks (Adam) spliced on one device against 1 rank alone, for a model
  whose parameters and optimizer state dominate (tests/programs/splice_train.py), as the server
  counts its live storage bytes after the ranks' last collective; with the server's summary
  (shared and private bytes, its replicas verdict);
- step time of N ranks on one device against N x the step time of one rank alone (DDP, Adam or
  SGD, an MLP whose operations take about a millisecond; each rank trains on its own batch, as a
  distributed sampler gives it, so only the update is the same across ranks), the CPU seconds
  per step of the ranks and the server together against N x those of one rank alone (on a
  machine with fewer cores than processes the honest overhead figure: wall time there also
  measures the CPU's saturation), and
  the dedup's own cost per step (comparing storages at collectives, copies before writes to
  shared storages), from the server's figures.

Options: --quick (10 timed steps, not 40), --optimizer adam|sgd, --steps-only (skip the memory part),
--width N (the step-time MLP, default 256),
--compare TREE (another checkout with its own .venv, e.g. main's: every figure measured for it, for
this tree, and for this tree with its spliced ranks side by side (server option --no-splice-lean, the
daemon's splice_lean = false) in turn, both optimizers; it prints the three together), --repeat N
(with --compare: N rounds of the three in turn, each step figure the median of its rounds; this
VM's step times wander by 10-20% between runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_collectives import _folder, _table  # noqa: E402
from singularity.proxy.control import ProxyControl  # noqa: E402
from tests.proxy.conftest import (  # noqa: E402
    PROGRAMS,
    communicate_all,
    start_linked_servers,
    start_ranks,
    stop_server,
)

STEP = r"""
import os, sys, time, torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
steps, width, optimizer_name, server_pid = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
def server_cpu():  # nanoseconds on a CPU, summed over the server's threads (schedstat)
    tasks = f"/proc/{server_pid}/task"
    return sum(int(open(f"{tasks}/{t}/schedstat").read().split()[0]) for t in os.listdir(tasks)) / 1e9
rank = int(os.environ["RANK"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
dist.init_process_group("nccl")
torch.manual_seed(0)
layers = [nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)]
net = nn.Sequential(*layers)
model = DistributedDataParallel(net.to("cuda"))
optimizer = (torch.optim.Adam if optimizer_name == "adam" else torch.optim.SGD)(model.parameters(), lr=1e-3)
batch = torch.Generator().manual_seed(1000 + rank)  # each rank its own batch, as a sampler gives it
x = torch.randn(64, width, generator=batch).to("cuda")
y = torch.randint(0, 10, (64,), generator=batch).to("cuda")
def step():
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad(); loss.backward(); optimizer.step()
    return loss.item()
for _ in range(5):
    step()
dist.barrier()
s0, c0, t0 = server_cpu(), time.process_time(), time.perf_counter()
for _ in range(steps):
    step()
t1, c1, s1 = time.perf_counter(), time.process_time(), server_cpu()
print((t1 - t0) / steps, (c1 - c0) / steps, (s1 - s0) / steps, flush=True)
dist.destroy_process_group()
"""

JOB = "job"
"""The job id the ranks give (tests.proxy.conftest.proxy_env)."""


def step_time(
    directory: Path, ranks: int, steps: int, width: int, optimizer: str, options: Sequence[str] = ()
) -> tuple[float, float, dict[str, Any]]:
    """Rank 0's seconds per step with `ranks` ranks on one device (its server started with these
    options), the CPU seconds per step of the ranks and the server together (over rank 0's timed
    steps), and the server's summary after."""
    servers = start_linked_servers(_folder(directory), 1, 4 << 30, options=options)
    try:
        command = ["-c", STEP, str(steps), str(width), optimizer, str(servers[0].proc.pid)]
        processes = start_ranks(command, ranks, [servers[0].socket])
        outputs = communicate_all(processes, 3600)
        assert all(p.returncode == 0 for p in processes), [err[-2000:] for _, err in outputs]
        with ProxyControl(servers[0].control) as control:
            figures = control.status()["dedup"]
        timed = [[float(v) for v in out.split()] for out, _err in outputs]
        cpu = sum(t[1] for t in timed) + timed[0][2]
        return timed[0][0], cpu, figures
    finally:
        stop_server(servers[0])


def held_memory(
    directory: Path, ranks: int, args: Sequence[str], options: Sequence[str] = ()
) -> tuple[int, int, dict[str, Any]]:
    """The server's live bytes once `ranks` ranks of splice_train.py finished training on one
    device (its server started with these options; as their last collective left them), its
    peak bytes, and its summary."""
    folder = _folder(directory)
    servers = start_linked_servers(folder, 1, 4 << 30, options=options)
    release, ready = folder / "release", folder / "ready-"
    command = [str(PROGRAMS / "splice_train.py"), *args, "--hold", str(release), "--ready", str(ready)]
    processes = start_ranks(command, ranks, [servers[0].socket])
    try:
        while not all(Path(f"{ready}{r}").exists() for r in range(ranks)):
            assert all(p.poll() is None for p in processes), "a rank failed"
            time.sleep(0.1)
        with ProxyControl(servers[0].control) as control:
            status = control.status()
            summary = control.replicas(JOB)
        return int(status["allocated"]), int(status["peak"]), summary
    finally:
        release.touch()
        for process in processes:
            process.communicate(timeout=600)
        stop_server(servers[0])


def memory_table(directory: Path) -> None:
    """Print the device memory of 4 spliced ranks against one rank alone (splice_train.py)."""
    model = ["--width", "512", "--layers", "4", "--steps", "4"]
    alone, alone_peak, _ = held_memory(directory, 1, model)
    spliced, spliced_peak, summary = held_memory(directory, 4, model)
    print("device memory, splice_train.py (MLP 4x512, Adam), after the last step; peak during the run")
    _table(
        [
            ["", "1 rank alone", "4 ranks spliced", "ratio", "shared", "private per rank", "replicas"],
            [
                "after the step", _mib(alone), _mib(spliced), f"{spliced / alone:.2f}x",
                _mib(summary["shared_bytes"]), _mib(max(summary["private_bytes"].values())),
                summary["replicas"],
            ],
            [
                "peak", _mib(alone_peak), _mib(spliced_peak), f"{spliced_peak / alone_peak:.2f}x",
                "", "", "",
            ],
        ]
    )  # fmt: skip


MEASURE = r"""
import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from bench.bench_splice import held_memory, step_time
what, args = sys.argv[2], json.loads(sys.argv[3])
with tempfile.TemporaryDirectory(prefix="bench-splice-") as folder:
    if what == "memory":
        print(json.dumps(held_memory(Path(folder), *args)))
    else:
        print(json.dumps(step_time(Path(folder), *args)))
"""
"""Runs one measurement of a tree's own bench_splice.py with that tree's interpreter (its server)."""


def measure(tree: Path, what: str, args: Sequence[Any], options: Sequence[str] = ()) -> Any:
    """One figure (`held_memory` or `step_time` with these arguments, and these server options if
    any) as the checkout `tree` has it."""
    if options:
        args = [*args, list(options)]
    command = [str(tree / ".venv" / "bin" / "python"), "-c", MEASURE, str(tree), what, json.dumps(args)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


SIDE_BY_SIDE = ("--no-splice-lean",)
"""Server options of spliced ranks that run side by side (the daemon's splice_lean = false)."""
Tree = tuple[str, Path, Sequence[str]]
"""A name, a checkout, and the options its servers start with (only this checkout's take any)."""


def compare_memory(trees: list[Tree], base: Path) -> None:
    """Print the device memory of 4 spliced ranks against 1 rank alone, for each tree in turn."""
    model = ["--width", "512", "--layers", "4", "--steps", "4"]
    rows = [
        ["tree", "1 rank", "4 ranks", "ratio", "1 rank peak", "4 ranks peak", "peak ratio", "squashed ops"]
    ]
    for name, tree, options in trees:
        alone, alone_peak, _ = measure(tree, "memory", [1, model], options)
        spliced, spliced_peak, summary = measure(tree, "memory", [4, model], options)
        rows.append(
            [
                name, _mib(alone), _mib(spliced), f"{spliced / alone:.2f}x", _mib(alone_peak),
                _mib(spliced_peak), f"{spliced_peak / alone_peak:.2f}x", str(summary.get("squashed", "-")),
            ]
        )  # fmt: skip
    print(f"device memory, splice_train.py (MLP 4x512, Adam), after the last step and peak; base = {base}")
    _table(rows)


def compare(base: Path, steps: int, width: int, memory: bool, repeat: int = 1) -> None:
    """Print memory (with `memory`) and step figures of the checkout `base` and of this one,
    measured in turn (`repeat` rounds of all the trees, each figure the median of its rounds)."""
    trees: list[Tree] = [("base", base, ()), ("this", REPO, ()), ("this, side by side", REPO, SIDE_BY_SIDE)]
    if memory:
        compare_memory(trees, base)
    rows = [
        [
            "optimizer",
            "ranks",
            "tree",
            "step (rank 0)",
            "CPU / step",
            "step ratio",
            "CPU ratio",
            "copied / step",
            "squashed / step",
        ]
    ]

    def medians(ranks: int, optimizer: str) -> dict[str, tuple[float, float, dict[str, Any]]]:
        runs: dict[str, list[tuple[float, float, dict[str, Any]]]] = {name: [] for name, _, _ in trees}
        for _round in range(repeat):
            for name, tree, options in trees:
                runs[name].append(measure(tree, "step", [ranks, steps, width, optimizer], options))
        return {
            name: (statistics.median(r[0] for r in got), statistics.median(r[1] for r in got), got[-1][2])
            for name, got in runs.items()
        }

    for optimizer in ("adam", "sgd"):
        single = medians(1, optimizer)
        for name, (one, one_cpu, _) in single.items():
            rows.append([optimizer, "1", name, _ms(one), _ms(one_cpu), "1.000", "1.000", "", ""])
        for ranks in (2, 4):
            for name, (many, cpu, figures) in medians(ranks, optimizer).items():
                one, one_cpu, _ = single[name]
                total_steps = steps + 5
                rows.append(
                    [
                        optimizer, str(ranks), name, _ms(many), _ms(cpu), f"{many / (ranks * one):.3f}",
                        f"{cpu / (ranks * one_cpu):.3f}", _mib(figures.get("copied_bytes", 0) / total_steps),
                        f"{figures.get('squashed', 0) / total_steps:.0f}",
                    ]
                )  # fmt: skip
    rounds = f", the median of {repeat} rounds" if repeat > 1 else ""
    print(
        f"\nstep time, DDP, MLP {width}, batch 64, {steps} steps after 5 warm-up{rounds}, against N x 1 rank "
        f"alone of the same tree; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    _table(rows)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def main(argv: list[str] | None = None) -> None:
    """Print the benchmark tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="of the step-time part")
    parser.add_argument("--steps-only", action="store_true", help="skip the device memory part")
    parser.add_argument("--compare", type=Path, help="another checkout (with .venv) measured in turn")
    parser.add_argument("--width", type=int, default=256, help="of the step-time part's MLP")
    parser.add_argument(
        "--repeat", type=int, default=1, help="with --compare: rounds of every tree, each figure their median"
    )
    options = parser.parse_args(argv)
    steps = 10 if options.quick else 40
    if options.compare is not None:
        if not (options.compare / ".venv" / "bin" / "python").exists():
            parser.error(f"{options.compare} has no .venv/bin/python")
        if options.repeat < 1:
            parser.error("--repeat must be at least 1")
        compare(options.compare.resolve(), steps, options.width, not options.steps_only, options.repeat)
        return
    with tempfile.TemporaryDirectory(prefix="bench-splice-") as folder:
        directory = Path(folder)
        if not options.steps_only:
            memory_table(directory)
        rows = [
            [
                "ranks on 1 device", "step (rank 0)", "N x 1 rank alone", "ratio", "CPU / step",
                "N x CPU alone", "CPU ratio", "dedup / step", "copied / step",
            ]
        ]  # fmt: skip
        width = options.width
        one, one_cpu, _ = step_time(directory, 1, steps, width, options.optimizer)
        rows.append(["1 (alone)", _ms(one), _ms(one), "1.000", _ms(one_cpu), _ms(one_cpu), "1.000", "", ""])
        for ranks in (2, 4):
            many, cpu, figures = step_time(directory, ranks, steps, width, options.optimizer)
            total_steps = steps + 5
            rows.append(
                [
                    f"{ranks}", _ms(many), _ms(ranks * one), f"{many / (ranks * one):.3f}",
                    _ms(cpu), _ms(ranks * one_cpu), f"{cpu / (ranks * one_cpu):.3f}",
                    _ms(figures.get("compare_seconds", 0.0) / total_steps),
                    _mib(figures.get("copied_bytes", 0) / total_steps),
                ]
            )  # fmt: skip
        print(
            f"\nstep time, DDP + {options.optimizer}, MLP {width}, batch 64, {steps} steps after 5 warm-up; "
            f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
        )
        _table(rows)


if __name__ == "__main__":
    main()
