"""Device proxy benchmark: per-op client cost, whole-run ratio proxied/direct, checkpoint size.

Run: .venv/bin/python bench/bench_proxy.py   (one intra-op thread everywhere; virtual device)
"""

from __future__ import annotations

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
t0 = time.perf_counter()
for i in range(steps):
    loss = step()
    if i % 10 == 9:
        loss.item()
loss.item()
print(time.perf_counter() - t0)
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


def _env(sock: Path | None) -> dict[str, str]:
    """A job process's environment: plain CPU, or proxied through the server at `sock`."""
    return base_env() if sock is None else proxy_env([sock], "bench")


def _run(code: str, args: list[str], sock: Path | None) -> str:
    r = subprocess.run(
        [PY, "-c", code, *args], env=_env(sock), capture_output=True, text=True, timeout=600, check=True
    )
    return r.stdout.strip()


def main() -> None:
    """Print the benchmark table."""
    with tempfile.TemporaryDirectory() as d:
        server = start_server(Path(d), "dev0", memory_bytes=8 << 30)
        sock = server.socket
        try:
            rows: list[tuple[str, str]] = []
            med, p99 = _run(PER_OP, [], sock).split()
            rows.append(("client cost per op, add/relu 64x64 (median)", f"{float(med):.1f} us"))
            rows.append(("client cost per op, add/relu 64x64 (p99)", f"{float(p99):.1f} us"))
            for label, args in (
                ("ms-scale ops (MLP 1024 wide, batch 1024)", ["1024", "1024", "30"]),
                ("small ops (MLP 64 wide, batch 32)", ["64", "32", "300"]),
            ):
                direct = min(float(_run(TRAIN, args, None)) for _ in range(2))
                proxied = min(float(_run(TRAIN, args, sock)) for _ in range(2))
                rows.append(
                    (
                        f"run time proxied/direct, {label}",
                        f"{proxied / direct:.3f} ({proxied:.2f} s / {direct:.2f} s)",
                    )
                )
            job = subprocess.Popen(
                [PY, "-c", CKPT], env=_env(sock), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            assert job.stdout is not None and job.stdin is not None
            job.stdout.readline()
            with ProxyControl(server.control) as ctl:
                ctl.quiesce("bench")
                rep = ctl.save("bench", Path(d) / "ckpt")
                ctl.resume("bench")
            job.stdin.write("\n")
            job.stdin.close()
            job.wait()
            rows.append(
                (
                    "checkpoint file bytes / live tensor bytes",
                    f"{rep['file_bytes'] / rep['live_bytes']:.4f} "
                    f"({rep['file_bytes']} / {rep['live_bytes']})",
                )
            )
        finally:
            stop_server(server)
    w = max(len(r[0]) for r in rows)
    print(f"{'measure':<{w}}  value")
    for name, value in rows:
        print(f"{name:<{w}}  {value}")


if __name__ == "__main__":
    main()
