"""CRIU's freeze of a torch process checkpointed in place: network lock or not, images to memory or disk.

Run as root: .venv/bin/python bench/bench_freeze.py [--rounds 8] [--dir /var/tmp]

One job (a process that imported torch and trains a small layer, started by the daemon's own
launcher, no TCP socket) is checkpointed in place over and over by the daemon's Checkpointer, the
four ways taking turns in each round so that the machine's load falls on each alike: CRIU's network
lock taken (`--network-lock nftables`, as every dump did before the lock was skipped for trees
without TCP sockets) or skipped, and the process images written to the image store on disk
(`--dir`) or staged in a tmpfs (/dev/shm) and moved to disk after. Printed: CRIU's frozen time
(median, min, max), its memory dump and write times (medians), and, when staged, how long the images
took to reach the disk.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_checkpoint import print_tables, root_scratch  # noqa: E402
from singularityd.checkpoint import Checkpointer, CheckpointResult, Criu, ImageStore, locate_criu  # noqa: E402
from singularityd.checkpoint.criu import CriuOptions  # noqa: E402
from singularityd.checkpoint.staging import StagingArea  # noqa: E402
from tests.checkpoint_helpers import kill_tree, start_job, wait_for_line  # noqa: E402

PROGRAM = """
import time, torch
torch.set_num_threads(1)
layer = torch.nn.Linear(256, 256)
x = torch.randn(64, 256)
print("ready", flush=True)
while True:
    layer(x).sum().backward()
    time.sleep(0.01)
"""
WAYS = ("lock, disk", "lock, memory", "no lock, disk", "no lock, memory")
HEADER = (
    "network lock, images",
    "frozen s median",
    "min",
    "max",
    "memory dump s",
    "memory write s",
    "to disk s",
)


async def measure(rounds: int, folder: Path) -> dict[str, list[CheckpointResult]]:
    """Checkpoint one job `rounds` times each way, the ways taking turns."""
    info = await asyncio.to_thread(locate_criu, "auto")
    (folder / "job.py").write_text(PROGRAM)
    job = await start_job(
        folder / "job",
        [sys.executable, str(folder / "job.py")],
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        cwd=folder,
    )
    memory = Path(tempfile.mkdtemp(prefix="sing-bench-freeze-", dir="/dev/shm"))
    try:
        assert wait_for_line(job.log(), "ready", 120), job.log().read_text()
        store = ImageStore(folder / "store")
        staging = StagingArea.open(memory, store.root)
        locked = CriuOptions(extra_dump_args=("--network-lock", info.network_lock))  # the last one counts
        checkpointers = {
            "lock, disk": Checkpointer(Criu(info, locked), store, keep=1),
            "lock, memory": Checkpointer(Criu(info, locked), store, keep=1, staging=staging),
            "no lock, disk": Checkpointer(Criu(info), store, keep=1),
            "no lock, memory": Checkpointer(Criu(info), store, keep=1, staging=staging),
        }
        results: dict[str, list[CheckpointResult]] = {way: [] for way in WAYS}
        for _ in range(rounds):
            for way in WAYS:
                result = await checkpointers[way].checkpoint(
                    "freeze", job.pid, owner_uid=0, owner_gid=0, leave_running=True
                )
                assert result.manifest.stats["network_locked"] is False  # the tree holds no TCP socket
                results[way].append(result)
                await asyncio.sleep(0.5)
        return results
    finally:
        kill_tree(job.pid)
        shutil.rmtree(memory, ignore_errors=True)


def cells(way: str, results: list[CheckpointResult]) -> tuple[str, ...]:
    """One row of the table."""
    frozen = [r.dump.pause_s for r in results]
    staged = [r.move_s for r in results if r.staged]
    return (
        way,
        f"{statistics.median(frozen):.3f}",
        f"{min(frozen):.3f}",
        f"{max(frozen):.3f}",
        f"{statistics.median(r.dump.memdump_us / 1e6 for r in results):.3f}",
        f"{statistics.median(r.dump.memwrite_us / 1e6 for r in results):.3f}",
        f"{statistics.median(staged):.2f}" if staged else "-",
    )


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="checkpoints taken each way")
    parser.add_argument("--dir", default="/var/tmp", help="where the image store goes (a disk)")
    args = parser.parse_args()
    folder = root_scratch("bench_freeze", args.dir, "CRIU needs it")
    try:
        results = asyncio.run(measure(args.rounds, folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    pages = results[WAYS[0]][0].dump.pages_written
    table = [cells(way, results[way]) for way in WAYS]
    summary = (
        f"{args.rounds} checkpoints each way, {pages * 4096 / 2**20:.0f} MiB of process memory written; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print_tables(summary, table, HEADER)


if __name__ == "__main__":
    main()
