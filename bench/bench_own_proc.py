"""What a job's own mount namespace and /proc cost its checkpoints and restores.

Run as root: .venv/bin/python bench/bench_own_proc.py [--rounds 8] [--dir /var/tmp]

Two copies of one job (a process that imported torch and trains a small layer) run side by side:
one started by the daemon's launcher (a PID namespace and a private mount namespace whose /proc is
its own, which CRIU dumps and restores with the job, through a mount yard), and one in a PID
namespace only, seeing the machine's /proc (how jobs ran before they got their own). Each round
checkpoints each in place (CRIU's frozen time, the checkpoint's wall time), then stops it with a
checkpoint and restores it (the restore's wall time), the two taking turns so that the machine's
load falls on both alike. Printed: medians, and the own-/proc job's over the other's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_checkpoint import print_tables, root_scratch  # noqa: E402
from bench.bench_freeze import PROGRAM  # noqa: E402
from singularityd.checkpoint import Checkpointer, Criu, ImageStore, locate_criu  # noqa: E402
from tests.checkpoint_helpers import children, kill_tree, start_job, wait_for_line  # noqa: E402

JOBS = ("own /proc", "machine's /proc")
HEADER = ("job", "frozen s", "checkpoint s", "restore s")
FIGURES = ("frozen", "checkpoint", "restore")


def start_without_mounts(folder: Path, log: Path) -> int:
    """The job in a PID namespace of its own but the machine's mounts; its init's host PID."""
    with log.open("a") as out:
        unshare = subprocess.Popen(
            ["unshare", "--pid", "--fork", "setsid", sys.executable, str(folder / "job.py")],
            cwd="/", stdout=out, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    deadline = time.monotonic() + 10
    while not (found := children(unshare.pid)):
        if time.monotonic() > deadline:
            raise RuntimeError("the job without mounts did not start")
        time.sleep(0.05)
    return found[0]


async def measure(rounds: int, folder: Path) -> dict[str, dict[str, list[float]]]:
    """Checkpoint, stop and restore both jobs `rounds` times, taking turns."""
    info = await asyncio.to_thread(locate_criu, "auto")
    (folder / "job.py").write_text(PROGRAM)
    own = await start_job(
        folder / "own",
        [sys.executable, str(folder / "job.py")],
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        cwd=folder,
    )
    machine_log = folder / "machine.log"
    pids = {JOBS[0]: own.pid, JOBS[1]: start_without_mounts(folder, machine_log)}
    try:
        for log in (own.log(), machine_log):
            assert wait_for_line(log, "ready", 120), log.read_text()
        checkpointer = Checkpointer(Criu(info), ImageStore(folder / "store"), keep=1)
        figures: dict[str, dict[str, list[float]]] = {job: {f: [] for f in FIGURES} for job in JOBS}
        for _ in range(rounds):
            for job in JOBS:
                name = job.replace(" ", "-").replace("'", "").replace("/", "")
                result = await checkpointer.checkpoint(
                    name, pids[job], owner_uid=0, owner_gid=0, leave_running=True
                )
                figures[job]["frozen"].append(result.dump.pause_s)
                figures[job]["checkpoint"].append(result.wall_s)
                await checkpointer.checkpoint(name, pids[job], owner_uid=0, owner_gid=0, leave_running=False)
                started = time.perf_counter()
                restored = await checkpointer.restore_latest(name)
                figures[job]["restore"].append(time.perf_counter() - started)
                pids[job] = restored.pid
                await asyncio.sleep(0.5)
        return figures
    finally:
        for pid in pids.values():
            kill_tree(pid)


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="checkpoints and restores of each job")
    parser.add_argument("--dir", default="/var/tmp", help="where the image store goes (a disk)")
    args = parser.parse_args()
    folder = root_scratch("bench_own_proc", args.dir, "CRIU needs it")
    try:
        figures = asyncio.run(measure(args.rounds, folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    medians = {job: [statistics.median(figures[job][f]) for f in FIGURES] for job in JOBS}
    table = [(job, *(f"{value:.3f}" for value in medians[job])) for job in JOBS]
    ratios = (own / other for own, other in zip(medians[JOBS[0]], medians[JOBS[1]], strict=True))
    table.append(("ratio", *(f"{ratio:.2f}x" for ratio in ratios)))
    summary = (
        f"{args.rounds} rounds, medians; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print_tables(summary, table, HEADER)


if __name__ == "__main__":
    main()
