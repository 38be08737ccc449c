"""Collectives on proxied devices against gloo, the consistent cut, DDP step time.

Run: .venv/bin/python bench/bench_collectives.py [--quick]   (one intra-op thread everywhere;
virtual devices; 2 ranks). Each measure runs the proxied and the direct gloo version one after
the other in the same run, so that their columns compare under the same machine load:
- allreduce (float32 sum) from 1 KiB to 64 MiB: time per call, with a device synchronize after
  each on the proxies (a gloo allreduce returns when done), and the bandwidth it gives
  (bytes / time), for 2 ranks on 2 devices (servers exchange over their links) and 2 ranks on
  one device (reduced inside one server); broadcast from rank 0 at 1 KiB and 1 MiB the same way,
  and a send/recv round trip (rank 0 sends, rank 1 sends it back);
- the consistent cut of a 2-rank DDP job on 2 devices: quiesce (every rank parked) and then
  settle rounds until `cut_reached`, as the daemon does before saving;
- a DDP step of a millisecond-scale model, proxied against direct gloo.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

PY = sys.executable
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from singularity.proxy.control import ProxyControl, cut_reached  # noqa: E402
from tests.proxy.conftest import (  # noqa: E402
    aborted_at_exit,
    communicate_all,
    start_linked_servers,
    start_ranks,
    stop_server,
)

ALLREDUCE = r"""
import os, sys, time, torch
import torch.distributed as dist
device = sys.argv[1]
sizes = [int(s) for s in sys.argv[2].split(",")]
kind = sys.argv[3] if len(sys.argv) > 3 else "all_reduce"
rank = int(os.environ["RANK"])
if device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
dist.init_process_group("nccl" if device == "cuda" else "gloo")
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
for size in sizes:
    x = torch.ones(size // 4, device=device)
    reps = max(3, min(200, (8 << 20) // size))
    def pingpong():
        if rank == 0:
            dist.send(x, 1); dist.recv(x, 1)
        else:
            dist.recv(x, 0); dist.send(x, 0)
    run = {"all_reduce": lambda: dist.all_reduce(x), "broadcast": lambda: dist.broadcast(x, src=0),
           "pingpong": pingpong}[kind]
    for _ in range(2):
        run()
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
        sync()
    if rank == 0:
        print(size, (time.perf_counter() - t0) / reps, flush=True)
dist.destroy_process_group()
"""

DDP_STEP = r"""
import os, sys, time, torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
device, steps = sys.argv[1], int(sys.argv[2])
rank = int(os.environ["RANK"])
if device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
dist.init_process_group("nccl" if device == "cuda" else "gloo")
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
model = DistributedDataParallel(net.to(device))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 256).to(device), torch.randint(0, 10, (64,)).to(device)
def step():
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad(); loss.backward(); optimizer.step()
    return loss.item()
for _ in range(5):
    step()
t0 = time.perf_counter()
for _ in range(steps):
    step()
if rank == 0:
    print((time.perf_counter() - t0) / steps, flush=True)
while os.environ.get("HOLD") and not os.path.exists(os.environ["HOLD"]):
    step()
dist.destroy_process_group()
"""


JOB = "job"
"""The job id the ranks give (tests.proxy.conftest.proxy_env)."""


def _folder(directory: Path) -> Path:
    """A new folder for one run's sockets."""
    folder = directory / f"run-{time.monotonic_ns()}"
    folder.mkdir()
    return folder


def run_ranks(code: str, args: Sequence[str], ranks: int, devices: int, directory: Path) -> str:
    """Rank 0's output of a program run to the end (devices=0: directly with gloo). A direct run
    that torch aborted at interpreter exit, its work done (`aborted_at_exit`), is taken again once."""
    for attempt in range(2):
        servers = start_linked_servers(_folder(directory), devices, 4 << 30) if devices else []
        try:
            processes = start_ranks(["-c", code, *args], ranks, [s.socket for s in servers] or None)
            outputs = communicate_all(processes, 1800)
        finally:
            for server in servers:
                stop_server(server)
        codes = [p.returncode for p in processes]
        if attempt == 0 and not devices and aborted_at_exit(codes):
            continue
        assert codes == [0] * ranks, f"a rank failed: {codes} {[err[-1500:] for _, err in outputs]}"
        return outputs[0][0]
    raise AssertionError("unreachable")


def cut_latency(directory: Path, rounds: int) -> tuple[float, float, float]:
    """Median seconds of quiesce, of settling to a consistent cut, of resume: 2-rank DDP, 2 devices."""
    servers = start_linked_servers(_folder(directory), 2)
    hold = directory / "hold"
    sockets = [s.socket for s in servers]
    processes = start_ranks(["-c", DDP_STEP, "cuda", "20"], 2, sockets, HOLD=str(hold))
    quiesce, settle, resume = [], [], []
    try:
        assert processes[0].stdout is not None
        processes[0].stdout.readline()  # timed steps done: the job now trains until `hold`
        controls = [ProxyControl(s.control) for s in servers]
        for _ in range(rounds):
            t0 = time.perf_counter()
            for control in controls:
                control.quiesce(JOB)
            t1 = time.perf_counter()
            previous = None
            while True:
                current = {i: control.settle(JOB) for i, control in enumerate(controls)}
                if cut_reached(previous, current):
                    break
                previous = current
            t2 = time.perf_counter()
            for control in controls:
                control.resume(JOB)
            t3 = time.perf_counter()
            quiesce.append(t1 - t0)
            settle.append(t2 - t1)
            resume.append(t3 - t2)
            time.sleep(0.2)
        for control in controls:
            control.close()
    finally:
        hold.touch()
        for process in processes:
            process.communicate(timeout=300)
        for server in servers:
            stop_server(server)
    return _median(quiesce), _median(settle), _median(resume)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main(argv: list[str] | None = None) -> None:
    """Print the benchmark tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and rounds")
    options = parser.parse_args(argv)
    sizes = [1 << 10, 64 << 10, 1 << 20, 16 << 20] if options.quick else [1 << 10 << 2 * k for k in range(9)]
    arg = ",".join(str(s) for s in sizes)
    with tempfile.TemporaryDirectory(prefix="bench-coll-") as folder:
        directory = Path(folder)
        columns = {
            "gloo (direct)": run_ranks(ALLREDUCE, ["cpu", arg], 2, 0, directory),
            "proxied, 2 devices": run_ranks(ALLREDUCE, ["cuda", arg], 2, 2, directory),
            "proxied, 1 device": run_ranks(ALLREDUCE, ["cuda", arg], 2, 1, directory),
        }
        times = {label: dict(line.split() for line in out.splitlines()) for label, out in columns.items()}
        print("allreduce, 2 ranks, float32 sum: time per call (bandwidth = bytes / time)")
        header = ["size", *times]
        rows = [header]
        for size in sizes:
            cells = [_size(size)]
            for label in times:
                seconds = float(times[label][str(size)])
                cells.append(f"{seconds * 1e3:8.3f} ms  {size / seconds / 1e6:8.1f} MB/s")
            rows.append(cells)
        _table(rows)

        small_table(
            directory, "broadcast", "broadcast from rank 0, 2 ranks: time per call (the root waits for every "
            "member's arrival)",
        )  # fmt: skip
        small_table(
            directory, "pingpong", "send/recv round trip, 2 ranks (rank 0 sends, rank 1 sends it back): time "
            "per round trip",
        )  # fmt: skip

        quiesce, settle, resume = cut_latency(directory, 3 if options.quick else 9)
        print("\nconsistent cut of a 2-rank DDP job on 2 devices (median)")
        _table(
            [
                ["quiesce (every rank parked)", "settle to a cut", "resume"],
                [f"{quiesce * 1e3:.1f} ms", f"{settle * 1e3:.1f} ms", f"{resume * 1e3:.1f} ms"],
            ]
        )

        steps = "20" if options.quick else "100"
        direct = float(run_ranks(DDP_STEP, ["cpu", steps], 2, 0, directory))
        proxied = float(run_ranks(DDP_STEP, ["cuda", steps], 2, 2, directory))
        print("\nDDP step, 2 ranks, MLP 256-256-256-10 (~135k parameters), batch 64")
        _table(
            [
                ["direct gloo", "proxied, 2 devices", "ratio"],
                [f"{direct * 1e3:.2f} ms", f"{proxied * 1e3:.2f} ms", f"{proxied / direct:.2f}x"],
            ]
        )


def small_table(directory: Path, kind: str, title: str) -> None:
    """Print the time of one `kind` of ALLREDUCE's program at 1 KiB and 1 MiB: gloo, 2 devices, 1."""
    small = (1 << 10, 1 << 20)
    arg = ",".join(str(s) for s in small)
    outputs = {
        "gloo (direct)": run_ranks(ALLREDUCE, ["cpu", arg, kind], 2, 0, directory),
        "proxied, 2 devices": run_ranks(ALLREDUCE, ["cuda", arg, kind], 2, 2, directory),
        "proxied, 1 device": run_ranks(ALLREDUCE, ["cuda", arg, kind], 2, 1, directory),
    }
    print(f"\n{title}")
    times = {label: dict(line.split() for line in out.splitlines()) for label, out in outputs.items()}
    rows = [["size", *times]]
    for size in small:
        rows.append([_size(size), *(f"{float(t[str(size)]) * 1e3:8.3f} ms" for t in times.values())])
    _table(rows)


def _table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths, strict=True)).rstrip())


if __name__ == "__main__":
    main()
