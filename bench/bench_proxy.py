"""Device proxy benchmark: per-op client cost, whole-run ratio proxied/direct, checkpoint size.

Run: .venv/bin/python bench/bench_proxy.py [--baseline REV]   (one intra-op thread everywhere;
virtual device). With --baseline, the proxy (server and in-job client) of git revision REV is
measured side by side with this tree's: the runs of a measure alternate between the two, each
first in turn, so that the columns compare under the same machine load.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PY = sys.executable
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from singularity.proxy.control import ProxyControl  # noqa: E402
from tests.proxy.conftest import base_env, proxy_env, start_server, stop_server  # noqa: E402

PER_OP = r"""
import time, torch
x = torch.randn(64, 64, device="cuda")
ts = []
for i in range(3000):
    t0 = time.perf_counter_ns()
    y = x + x
    t1 = time.perf_counter_ns()
    z = y.relu()
    t2 = time.perf_counter_ns()
    ts += [t1 - t0, t2 - t1]
    if i % 100 == 99:
        z.sum().item()
ts = sorted(ts[2000:])
print(ts[len(ts) // 2] / 1000, ts[int(len(ts) * 0.99)] / 1000)
"""

TRAIN = r"""
import sys, time, torch
from torch import nn
width, batch, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                  nn.Linear(width, 1)).to(dev)
opt = torch.optim.SGD(m.parameters(), lr=1e-4)
x = torch.randn(batch, width).to(dev)
def step():
    loss = m(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    return loss
step().item()
t0, c0 = time.perf_counter(), time.process_time()
for i in range(steps):
    loss = step()
    if i % 10 == 9:
        loss.item()
loss.item()
print(time.perf_counter() - t0, time.process_time() - c0)
"""

CKPT = r"""
import sys, torch
from torch import nn
m = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512)).cuda()
opt = torch.optim.Adam(m.parameters())
x = torch.randn(256, 512, device="cuda")
m(x).sum().backward(); opt.step()
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
"""

RUNS = (
    ("ms-scale ops (MLP 1024 wide, batch 1024)", ["1024", "1024", "30"]),
    ("small ops (MLP 64 wide, batch 32)", ["64", "32", "1500"]),
)

REPETITIONS = 4
"""Runs of each kind per measure; the best is reported (the others lost time to other load)."""


class Proxied:
    """One proxy under test: a source tree and the server started from it."""

    def __init__(self, label: str, tree: Path, directory: Path) -> None:
        self.label = label
        self.tree = tree
        self.server = start_server(directory, f"dev-{label}", memory_bytes=8 << 30, tree=tree)

    def env(self) -> dict[str, str]:
        """A job process's environment on this proxy."""
        return proxy_env([self.server.socket], "bench", tree=self.tree)


def _run(code: str, args: list[str], env: dict[str, str]) -> str:
    r = subprocess.run(
        [PY, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600, check=True
    )
    return r.stdout.strip()


def _timed(code: str, args: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) the training loop of a run took, as it measured them."""
    wall, cpu = _run(code, args, env).split()
    return float(wall), float(cpu)


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _timed_proxied(args: list[str], proxy: Proxied) -> tuple[float, float, float]:
    """(wall, job CPU, server CPU) seconds of a proxied run; the server's over the whole job."""
    before = _cpu_seconds(proxy.server.proc.pid)
    wall, cpu = _timed(TRAIN, args, proxy.env())
    return wall, cpu, _cpu_seconds(proxy.server.proc.pid) - before


def _checkpoint_ratio(proxy: Proxied, directory: Path) -> str:
    """Bytes a checkpoint of a small Adam-trained model writes per live tensor byte."""
    job = subprocess.Popen(
        [PY, "-c", CKPT], env=proxy.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert job.stdout is not None and job.stdin is not None
    job.stdout.readline()
    with ProxyControl(proxy.server.control) as ctl:
        ctl.quiesce("bench")
        rep = ctl.save("bench", directory / "ckpt")
        ctl.resume("bench")
    job.stdin.write("\n")
    job.stdin.close()
    job.wait()
    return f"{rep['file_bytes'] / rep['live_bytes']:.4f} ({rep['file_bytes']} / {rep['live_bytes']})"


def _export(revision: str, directory: Path) -> Path:
    """A copy of the source tree at a git revision."""
    tree = directory / "baseline"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


def measure(proxies: list[Proxied], directory: Path) -> list[tuple[str, list[str]]]:
    """The benchmark rows: one value per proxy, measured one after the other."""
    rows: list[tuple[str, list[str]]] = []
    per_op = [_run(PER_OP, [], p.env()).split() for p in proxies]
    rows.append(("client cost per op, add/relu 64x64 (median)", [f"{float(m):.1f} us" for m, _ in per_op]))
    rows.append(("client cost per op, add/relu 64x64 (p99)", [f"{float(p):.1f} us" for _, p in per_op]))
    for label, args in RUNS:
        directs: list[tuple[float, float]] = []
        runs: dict[str, list[tuple[float, float, float]]] = {p.label: [] for p in proxies}
        for repetition in range(REPETITIONS):  # interleaved, each proxy first in turn
            directs.append(_timed(TRAIN, args, base_env()))
            for p in proxies if repetition % 2 == 0 else proxies[::-1]:
                runs[p.label].append(_timed_proxied(args, p))
        direct, direct_cpu = min(wall for wall, _ in directs), min(cpu for _, cpu in directs)
        values, cpu = [], []
        for p in proxies:
            proxied = min(wall for wall, _, _ in runs[p.label])
            job_cpu = min(job for _, job, _ in runs[p.label])
            server_cpu = min(server for _, _, server in runs[p.label])
            values.append(f"{proxied / direct:.3f} ({proxied:.2f} s / {direct:.2f} s)")
            cpu.append(f"{job_cpu / direct_cpu:.2f} + {server_cpu / direct_cpu:.2f}")
        rows.append((f"run time proxied/direct, {label}", values))
        rows.append((f"CPU time job + server / direct, {label}", cpu))
    # the control protocol is this tree's, so the checkpoint is measured on this tree only
    rows.append(
        (
            "checkpoint file bytes / live tensor bytes",
            ["-"] * (len(proxies) - 1) + [_checkpoint_ratio(proxies[-1], directory)],
        )
    )
    return rows


def main(argv: list[str] | None = None) -> None:
    """Print the benchmark table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--baseline", help="git revision whose proxy is measured side by side with this tree's"
    )
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        directory = Path(d)
        proxies: list[Proxied] = []
        try:
            if options.baseline:
                proxies.append(Proxied(options.baseline, _export(options.baseline, directory), directory))
            proxies.append(Proxied("this tree", REPO, directory))
            rows = measure(proxies, directory)
        finally:
            for p in proxies:
                stop_server(p.server)
    header = ["measure", *(p.label for p in proxies)]
    widths = [max(len(header[i]), *(len(([r[0], *r[1]])[i]) for r in rows)) for i in range(len(header))]
    for line in [header, *([r[0], *r[1]] for r in rows)]:
        print("  ".join(f"{cell:<{w}}" for cell, w in zip(line, widths, strict=True)).rstrip())


if __name__ == "__main__":
    main()
