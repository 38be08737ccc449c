"""Proxy server cost per operation: the frames of a small-op training run, replayed in process.

Run: .venv/bin/python bench/bench_server.py [--baseline REV]
The in-job client and the server of a source tree (this one, and REV's with --baseline) run the
small-op MLP of bench_proxy.py for 400 steps while every frame the job sends is recorded; the
frames are then run again by that tree's `Executor` in one process, from the first frame on
(so handles, operators and plans exist), and the cost of the last three quarters is reported
per operation: CPU time of the thread (so that other work on the machine matters less) and
wall time, best of 5. What is measured is the server's own work (decoding, handle lookups,
the operators, bookkeeping); the socket is not.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_proxy import _export  # noqa: E402
from bench.bench_wire import RECORD  # noqa: E402
from tests.proxy.conftest import base_env, proxy_env, start_server, stop_server  # noqa: E402

REPLAY = r"""
import base64, json, sys, time, torch
torch.set_num_threads(1)
from singularity.proxy.bootstrap._singularity_proxy import protocol
from singularity.proxy.server.executor import Executor
from singularity.proxy.server.device_memory import DeviceMemory
from singularity.proxy.server.session import Session
assert Executor.__module__ and sys.modules[Executor.__module__].__file__.startswith(sys.argv[2]), "wrong tree"
log = json.load(open(sys.argv[1]))
frames = [(k, b.encode(), [memoryview(bytearray(base64.b64decode(x))) for x in d]) for k, b, d in log]
def replay():
    memory: DeviceMemory[Session] = DeviceMemory(0, 8 << 30)
    executor = Executor(torch.device("cpu"), memory)
    session = Session("bench", 0, 0, memory)
    torch.set_grad_enabled(True)
    count = 0
    for index, (kind, body, buffers) in enumerate(frames):
        if index == len(frames) // 4:
            count, cpu, wall = 0, time.thread_time(), time.perf_counter()
        decoded = protocol.Frame(kind, body, buffers).decode()
        request = decoded[1] if kind == protocol.REQUEST else None
        if hasattr(executor, "run_batch"):
            executor.run_batch(session, decoded[0], request, buffers)
        else:  # a tree whose sessions run their frames in threads (runner.py)
            executor.run_ops(session, decoded[0], 0, len(decoded[0]), buffers)
            if request is not None:
                executor.answer(session, request, buffers)
        count += len(decoded[0]) + (request is not None)
    return (time.thread_time() - cpu) / count * 1e6, (time.perf_counter() - wall) / count * 1e6
results = [replay() for _ in range(5)]
operations = sum(len(json.loads(body)[0]) for _, body, _ in frames)
print(min(r[0] for r in results), min(r[1] for r in results), operations)
"""


def record(tree: Path, directory: Path, name: str) -> Path:
    """The frames a small-op training run sends to the server of a source tree."""
    frames = directory / f"frames-{name}.json"
    server = start_server(directory, f"record-{name}", tree=tree)
    try:
        env = proxy_env([server.socket], "bench-server", tree=tree)
        command = [sys.executable, "-c", RECORD, str(frames), "400"]
        subprocess.run(command, env=env, check=True, timeout=600)
    finally:
        stop_server(server)
    return frames


def replay(tree: Path, frames: Path) -> tuple[float, float, int]:
    """(CPU us per operation, wall us per operation, operations) of the tree's executor on frames."""
    env = base_env()
    env["PYTHONPATH"] = str(tree)
    done = subprocess.run(
        [sys.executable, "-c", REPLAY, str(frames), str(tree)],
        env=env, cwd=tree, capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    cpu, wall, count = done.stdout.split()
    return float(cpu), float(wall), int(count)


def main(argv: list[str] | None = None) -> None:
    """Print the per-operation cost of the server of this tree (and of a baseline revision)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="git revision whose server is measured side by side")
    parser.add_argument("--rounds", type=int, default=3, help="replays of each tree, taken in turn")
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        directory = Path(d)
        trees = [("this tree", REPO)]
        if options.baseline:
            trees.insert(0, (options.baseline, _export(options.baseline, directory)))
        frames = [record(tree, directory, str(i)) for i, (_, tree) in enumerate(trees)]
        best: list[tuple[float, float, int]] = [(1e9, 1e9, 0)] * len(trees)
        for _ in range(options.rounds):  # the trees in turn, so that both see the same machine
            for i, (_, tree) in enumerate(trees):
                cpu, wall, count = replay(tree, frames[i])
                best[i] = (min(best[i][0], cpu), min(best[i][1], wall), count)
    steps = 400
    print(f"{'server':<12} {'CPU us/op':>10} {'wall us/op':>11} {'ops/step':>9} {'CPU us/step':>12}")
    for (label, _), (cpu, wall, count) in zip(trees, best, strict=True):
        print(f"{label:<12} {cpu:>10.2f} {wall:>11.2f} {count / steps:>9.1f} {cpu * count / steps:>12.0f}")


if __name__ == "__main__":
    main()
