"""Checkpoint pause as the program feels it, for 256 MiB to 4 GiB of device state, with and without
pre-copy, with the process images staged in memory or written straight to disk.

Run as root: .venv/bin/python bench/bench_pause.py [--sizes 256,1024,4096] [--dir /var/tmp]
    [--modes on-memory,on-disk,off-memory,off-disk]

A real daemon (virtual device, proxy servers, CRIU) runs tests/programs/stall_probe.py holding
SIZE MiB of tensors on its device and training a small model; the bench takes `sing checkpoint`
and reads the program's own longest step around it (by the wall clock), the pause the daemon
reports, CRIU's freeze, and the time until the checkpoint is complete. Each size is measured in
each mode: the proxies' pre-copy on (proxy_pre_copy = 2) or off (0), and CRIU's process images
staged in memory (checkpoint_staging = /dev/shm, moved to disk after the job runs again) or
written straight to disk (checkpoint_staging = ''), one daemon per mode, one after the other. Beside
them, in the same run: the machine's memory copy bandwidth (1 GiB, into memory already touched
and into fresh memory) and the disk's write bandwidth where the images go, since the pause is
bounded by the one and the time to complete by the other.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_checkpoint import print_tables, root_scratch  # noqa: E402
from tests.helpers import Daemon, running_daemon, wait_until  # noqa: E402
from tests.proxy.conftest import PROGRAMS, PYTHON  # noqa: E402
from tests.test_pause import longest_stall  # noqa: E402

MiB = 1 << 20
JOB_OPTIONS = ["--env", "OMP_NUM_THREADS=1", "--cwd", str(PROGRAMS)]


@dataclass(frozen=True)
class Row:
    """One checkpoint of one job, measured."""

    mib: int
    pre_copy: bool
    staged: bool
    felt_s: float
    reported_s: float
    frozen_s: float
    copied_in_pause_mib: float
    pre_copy_s: float
    move_s: float
    request_to_complete_s: float
    complete_after_pause_s: float


def copy_bandwidth_gbs(mib: int = 1024) -> tuple[float, float]:
    """GB/s of a 1 GiB memory copy (one thread): into touched memory (best of 3), into fresh memory."""
    torch.set_num_threads(1)
    source = torch.ones(mib * MiB, dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)
    warm = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        target.copy_(source)
        warm = min(warm, time.perf_counter() - began)
    del target
    began = time.perf_counter()
    fresh = torch.empty_like(source)
    fresh.copy_(source)
    cold = time.perf_counter() - began
    return source.numel() / warm / 1e9, source.numel() / cold / 1e9


def disk_write_gbs(folder: Path, mib: int = 1024) -> float:
    """GB/s of writing 1 GiB into a new file in `folder` (as the checkpoint does: no fsync)."""
    block = os.urandom(16 * MiB)
    path = folder / "write-test"
    began = time.perf_counter()
    with path.open("wb") as out:
        for _ in range(mib // 16):
            out.write(block)
    seconds = time.perf_counter() - began
    path.unlink()
    return mib * MiB / seconds / 1e9


def manifest_stats(daemon: Daemon, job: int, seq: int) -> dict[str, Any]:
    """The figures a checkpoint's manifest records (its pause, its staging)."""
    path = daemon.state_dir / "checkpoints" / str(job) / f"{seq:08d}" / "manifest.json"
    stats: dict[str, Any] = json.loads(path.read_text())["stats"]
    return stats


def measure(daemon: Daemon, root: Path, mib: int, pre_copy: bool, staged: bool) -> Row:
    """One job holding `mib` MiB, checkpointed once in place."""
    hold = root / f"hold-{mib}-{pre_copy}-{staged}"
    job = daemon.submit(PYTHON, "stall_probe.py", str(hold), str(mib), options=JOB_OPTIONS)
    log = daemon.state_dir / "jobs" / str(job) / "logs" / "rank-0.log"
    try:
        wait_until(lambda: log.exists() and "ready" in log.read_text(), timeout=600)
        time.sleep(3)  # steady steps
        began = time.time()
        result = daemon.sing("checkpoint", str(job), timeout=1800)
        request_s = time.time() - began
        assert result.code == 0, result.err
        listed = daemon.job(job)["checkpoint_list"][-1]
        felt = wait_until(lambda: longest_stall(log, began), timeout=60)
        stats = manifest_stats(daemon, job, listed["seq"])
        pause, staging = stats["pause"], stats["staging"]
        assert staging["staged"] == staged, staging
        device = pause["device"]
        assert isinstance(device, dict)
        return Row(
            mib=mib,
            pre_copy=pre_copy,
            staged=staged,
            felt_s=felt,
            reported_s=listed["pause_seconds"],
            frozen_s=float(str(pause["frozen_s"])),
            copied_in_pause_mib=listed["paused_bytes"] / MiB,
            pre_copy_s=float(device["precopy_seconds"]),
            move_s=float(staging["move_s"]),
            request_to_complete_s=request_s,
            complete_after_pause_s=listed["complete_seconds"],
        )
    finally:
        hold.touch()
        daemon.sing("cancel", str(job))
        daemon.sing("wait", str(job), timeout=300)


HEADER = (
    "device state MiB",
    "pre-copy",
    "process images",
    "pause felt s",
    "pause reported s",
    "CRIU freeze s",
    "copied in pause MiB",
    "pre-copy s",
    "images to disk s",
    "complete after pause s",
    "request to complete s",
    "pause / (size / copy bw)",
)


def cells(row: Row, copy_gbs: float) -> tuple[str, ...]:
    """One table row; the last column compares the pause with copying the whole state once."""
    copy_s = row.mib * MiB / copy_gbs / 1e9
    return (
        str(row.mib),
        "on" if row.pre_copy else "off",
        "memory" if row.staged else "disk",
        f"{row.felt_s:.3f}",
        f"{row.reported_s:.3f}",
        f"{row.frozen_s:.3f}",
        f"{row.copied_in_pause_mib:.1f}",
        f"{row.pre_copy_s:.1f}" if row.pre_copy else "-",
        f"{row.move_s:.2f}" if row.staged else "-",
        f"{row.complete_after_pause_s:.1f}",
        f"{row.request_to_complete_s:.1f}",
        f"{row.felt_s / copy_s:.2f}",
    )


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,1024,4096", help="device state sizes in MiB")
    parser.add_argument("--dir", default="/var/tmp", help="where the daemon's state and images go")
    parser.add_argument(
        "--modes",
        default="on-memory,on-disk,off-memory,off-disk",
        help="pre-copy (on/off) and where CRIU writes the process images (memory/disk), each a daemon",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    modes = [tuple(m.split("-")) for m in args.modes.split(",")]
    if any(len(m) != 2 or m[0] not in ("on", "off") or m[1] not in ("memory", "disk") for m in modes):
        print(f"bench_pause: --modes takes on|off-memory|disk, not {args.modes!r}", file=sys.stderr)
        raise SystemExit(2)
    root = root_scratch("bench_pause", args.dir, "the daemon and CRIU need it")
    rows: list[Row] = []
    try:
        warm_gbs, fresh_gbs = copy_bandwidth_gbs()
        disk_gbs = disk_write_gbs(root)
        memory = max(16, 2 * max(sizes) // 1024 + 2)
        for copy_mode, image_mode in modes:
            pre_copy, staged = copy_mode == "on", image_mode == "memory"
            config = {
                "proxy_pre_copy": 2 if pre_copy else 0,
                "virtual_device_memory_gib": memory,
                "checkpoint_staging": "/dev/shm" if staged else "",
            }
            folder = root / f"daemon-{copy_mode}-{image_mode}"
            with running_daemon(folder, virtual_devices=1, config=config) as daemon:
                rows += [measure(daemon, root, mib, pre_copy, staged) for mib in sizes]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows.sort(key=lambda r: (r.mib, not r.pre_copy, not r.staged))
    table = [cells(r, warm_gbs) for r in rows]
    summary = (
        f"memory copy bandwidth (1 thread, 1 GiB): {warm_gbs:.2f} GB/s into touched memory, "
        f"{fresh_gbs:.2f} GB/s into fresh memory; disk write bandwidth ({args.dir}): {disk_gbs:.2f} GB/s; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print_tables(summary, table, HEADER)


if __name__ == "__main__":
    main()
