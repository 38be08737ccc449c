"""Make docs/sing-top.svg, the README's picture of `sing top`, from the real app and a real daemon.

It starts a daemon with 4 virtual devices, runs a two-rank PyTorch job on two of them through the
device proxies, checkpoints a counter, suspends a job and queues one that cannot fit, then takes
Textual's screenshot of `sing top` with the PyTorch job chosen, and cleans up (jobs, proxy servers,
the folder). Needs root and CRIU (scripts/setup).

Run: .venv/bin/python docs/screenshot_top.py [OUTPUT.svg]
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from singularity.cli.source import DaemonSource  # noqa: E402
from singularity.cli.top.app import TopApp  # noqa: E402
from tests.conftest import _kill_jobs_under  # noqa: E402
from tests.helpers import Daemon, running_daemon, submit_counter, wait_until  # noqa: E402

TRAIN = """
import os, time, torch
from torch import nn
rank = int(os.environ["LOCAL_RANK"])
device = f"cuda:{rank}"
torch.manual_seed(rank)
model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
x, y = torch.randn(256, 512, device=device), torch.randint(0, 10, (256,), device=device)
step = 0
while not os.path.exists(os.environ["RELEASE"]):
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"rank {rank} step {step:5d} loss {loss.item():.6f}", flush=True)
    step += 1
    time.sleep(0.1)
"""


def prepare(daemon: Daemon, release: Path) -> int:
    """Jobs in the states worth showing; returns the PyTorch job's id."""
    script = daemon.root / "train.py"
    script.write_text(TRAIN)
    script.chmod(0o644)
    options = ["--name", "train-mlp", "--gpus", "2", "--ranks", "2", "--priority", "5"]
    options += ["--cwd", str(daemon.root), "--env", f"RELEASE={release}", "--env", "OMP_NUM_THREADS=1"]
    train = daemon.submit(sys.executable, "train.py", options=options)
    counter = submit_counter(daemon, release)
    notebook = daemon.submit("sleep", "3600", options=["--name", "notebook"])
    for job in (train, counter, notebook):
        daemon.wait_state(job, "RUNNING")
    wait_until(lambda: daemon.sing("logs", str(train)).out.count("step") >= 3, timeout=120)
    for _ in range(2):
        assert daemon.sing("checkpoint", str(counter)).code == 0
    assert daemon.sing("checkpoint", str(train)).code == 0
    assert daemon.sing("suspend", str(notebook)).code == 0
    daemon.submit("sleep", "3600", options=["--name", "big-run", "--gpus", "4"])
    return train


async def screenshot(daemon: Daemon, job: int, output: Path) -> None:
    """Run the app until the job's detail and log show, then save its screenshot."""
    app = TopApp(DaemonSource(daemon.socket), refresh_seconds=0.5)
    async with app.run_test(size=(150, 44)) as pilot:
        deadline = time.monotonic() + 60
        while not (app._detail is not None and app._detail.job.id == job and app.devices[0].sessions):
            assert time.monotonic() < deadline, "sing top did not show the job"
            await pilot.pause(0.1)
        await pilot.pause(1.0)
        app.save_screenshot(filename=output.name, path=str(output.parent))


def main() -> None:
    """Prepare, take the picture, clean up."""
    output = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "docs" / "sing-top.svg"
    root = Path(tempfile.mkdtemp(prefix="sing-docs-", dir="/tmp"))
    os.chmod(root, 0o755)
    release = root / "release"
    with running_daemon(root) as daemon:
        try:
            train = prepare(daemon, release)
            asyncio.run(screenshot(daemon, train, output))
        finally:
            release.touch()
            ids = [str(job["id"]) for job in daemon.sing("ps", "-o", "json").json()]
            if ids:
                daemon.sing("cancel", *ids)
    _kill_jobs_under(root / "state")
    shutil.rmtree(root, ignore_errors=True)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
