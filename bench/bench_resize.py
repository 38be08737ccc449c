"""Resize and splicing costs: `sing resize` end to end, and the step time of ranks sharing a device.

Run as root: .venv/bin/python bench/bench_resize.py [--ballast 0,256] [--steps 50] [--dir /var/tmp]
(--ballast '' measures the splicing part alone.)

A real daemon (4 virtual devices, proxy servers, CRIU) runs tests/programs/step_timer.py.
Resize: a 4-rank job holding BALLAST MiB of device tensors (split over its ranks) is resized
4 -> 2 and then 2 -> 4 devices; the time is the wall time of `sing resize` (checkpoint, stop,
regroup of the device state, restore, running again). Splicing: the mean step time of 2 and 4
ranks sharing one device, over the step time of one rank alone on a device times the ranks;
the ops are millisecond-scale (four 256x256 linear layers, batch 64, one allreduce per step).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers import Daemon, running_daemon  # noqa: E402
from tests.proxy.conftest import PROGRAMS, PYTHON  # noqa: E402

JOB_OPTIONS = ["--env", "OMP_NUM_THREADS=1", "--cwd", str(PROGRAMS)]


def submit(daemon: Daemon, ranks: int, gpus: int, args: list[str]) -> int:
    """Submit step_timer.py as a job of `ranks` ranks on `gpus` devices."""
    options = [*JOB_OPTIONS, "--ranks", str(ranks), "--gpus", str(gpus)]
    return daemon.submit(PYTHON, "step_timer.py", *args, options=options)


def step_ms(daemon: Daemon, job: int, ranks: int) -> float:
    """The slowest rank's mean step time, once the job has succeeded."""
    assert daemon.sing("wait", str(job), timeout=1200).code == 0
    times = []
    for rank in range(ranks):
        log = daemon.sing("logs", "--rank", str(rank), str(job)).out
        found = re.search(r"step_ms ([0-9.]+)", log)
        assert found, log
        times.append(float(found.group(1)))
    return max(times)


def resize_seconds(daemon: Daemon, root: Path, ballast: int) -> tuple[float, float]:
    """Wall time of `sing resize` 4 -> 2, then 2 -> 4, for a job holding `ballast` MiB."""
    release = root / f"release-{ballast}"
    job = submit(
        daemon, 4, 4, ["--steps", "1", "--warmup", "0", "--ballast", str(ballast), "--hold", str(release)]
    )
    daemon.wait_state(job, "RUNNING")
    while "step_ms" not in daemon.sing("logs", "--rank", "3", str(job)).out:
        time.sleep(0.2)
    timed = []
    for gpus in (2, 4):
        began = time.perf_counter()
        result = daemon.sing("resize", str(job), "--gpus", str(gpus), timeout=900)
        timed.append(time.perf_counter() - began)
        assert result.code == 0, result.err
    release.touch()
    assert daemon.sing("wait", str(job), timeout=600).code == 0
    return timed[0], timed[1]


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ballast", default="0,256", help="MiB of device state per job, comma-separated ('': no resize)"
    )
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dir", default="/var/tmp", help="where the daemon's state and images go")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_resize: run as root (the daemon and CRIU need it)", file=sys.stderr)
        raise SystemExit(2)
    root = Path(tempfile.mkdtemp(prefix="sing-bench-resize-", dir=args.dir))
    root.chmod(0o755)
    steps = ["--steps", str(args.steps)]
    try:
        with running_daemon(root / "daemon", virtual_devices=4) as daemon:
            resizes = [
                (mib, *resize_seconds(daemon, root, int(mib))) for mib in args.ballast.split(",") if mib
            ]
            alone = step_ms(daemon, submit(daemon, 1, 1, steps), 1)
            spliced = {n: step_ms(daemon, submit(daemon, n, 1, steps), n) for n in (2, 4)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if resizes:
        print("\nresize (4 ranks), wall time of `sing resize`:")
        print(f"{'device state':>14} {'4 -> 2':>9} {'2 -> 4':>9}")
    for mib, down, up in resizes:
        print(f"{mib + ' MiB':>14} {down:>8.2f}s {up:>8.2f}s")
    print("\nsplicing, mean step time (ms-scale ops, one allreduce per step):")
    print(f"{'ranks on 1 device':>18} {'step':>10} {'N x alone':>10} {'ratio':>7}")
    print(f"{'1 (alone)':>18} {alone:>8.2f}ms {alone:>8.2f}ms {1.0:>7.3f}")
    for n, ms in spliced.items():
        print(f"{n:>18} {ms:>8.2f}ms {n * alone:>8.2f}ms {ms / (n * alone):>7.3f}")


if __name__ == "__main__":
    main()
