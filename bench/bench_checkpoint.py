"""Benchmark of CRIU checkpoints: dump, pause, restore and image size for jobs of 100 MB to 4 GB.

Each job is one process holding a buffer of the given size, started by the daemon's own launcher
(own PID namespace, supervisor, log files). For each size it measures: a checkpoint that leaves
the job running (CRIU wall time, the pause = time frozen, image size, time to hash and record),
the same with pre-copy (pre-dump, then DIRTY of the buffer rewritten, then the final dump) when
the kernel tracks dirty memory, and a preempt-and-restore. The machine's memory copy bandwidth,
measured in the same run, is the reference: the headline is image throughput / copy bandwidth.

Run as root from the repository root: `python bench/bench_checkpoint.py [--quick]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from singularityd.checkpoint import Checkpointer, CheckpointUnavailable, Criu, ImageStore
from singularityd.checkpoint import locate_criu as _locate

WORKLOAD = """
import signal, sys
import numpy as np
mb, frac = int(sys.argv[1]), float(sys.argv[2])
buf = np.ones(mb * 2**20 // 8, dtype=np.float64)
count = 0
def dirty(signum, frame):
    global count
    count += 1
    buf[: int(len(buf) * frac)] += 1.0
    print("dirtied", count, flush=True)
signal.signal(signal.SIGUSR1, dirty)
print("ready", flush=True)
while True:
    signal.pause()
"""

MiB = 2**20


@dataclass
class Row:
    """Measurements for one job size."""

    rss_mib: int
    image_mib: float
    dump_s: float
    pause_s: float
    record_s: float
    precopy_pause_s: float | None
    precopy_total_frozen_s: float | None
    preempt_dump_s: float
    preempt_frozen_s: float
    preempt_locked: bool
    restore_s: float
    verify_s: float
    copy_gbs: float

    @property
    def throughput_gbs(self) -> float:
        """Image bytes written per second of CRIU dump time."""
        return self.image_mib * MiB / self.dump_s / 1e9

    @property
    def ratio(self) -> float:
        """Image throughput as a fraction of the machine's memory copy bandwidth."""
        return self.throughput_gbs / self.copy_gbs


def copy_bandwidth_gbs(mib: int = 1024, repeats: int = 3) -> float:
    """Bytes copied per second by a large numpy copy (best of a few), in GB/s."""
    src = np.ones(mib * MiB // 8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return src.nbytes / best / 1e9


def _helpers() -> Any:
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    import tests.checkpoint_helpers as h

    return h


def _wait_line(path: Path, needle: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() or needle not in path.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{needle!r} did not appear in {path}")
        time.sleep(0.02)


async def bench_size(cp: Checkpointer, work: Path, mib: int, dirty: float, copy_gbs: float) -> Row:
    """Measure one job of `mib` MiB."""
    h = _helpers()
    script = work / "workload.py"
    script.write_text(WORKLOAD)
    job_files = work / f"w{mib}"
    launched = await h.start_job(
        job_files,
        [sys.executable, str(script), str(mib), str(dirty)],
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        cwd=work,
    )
    pid, log = launched.pid, launched.log()
    live = [pid]
    try:
        _wait_line(log, "ready", 120)
        (rank,) = h.children(pid)
        job = f"bench-{mib}"
        r = await cp.checkpoint(job, pid, owner_uid=0, owner_gid=0, leave_running=True, pre_copy=0)
        record_s = r.wall_s - r.dump.wall_s
        pre_pause: float | None = None
        pre_total: float | None = None
        if cp.criu.info.dirty_tracking:
            count = [0]

            def make_dirty(images: Path) -> None:
                count[0] += 1
                os.kill(rank, signal.SIGUSR1)
                _wait_line(log, f"dirtied {count[0]}", 60)

            rp = await cp.checkpoint(
                job,
                pid,
                owner_uid=0,
                owner_gid=0,
                leave_running=True,
                pre_copy=1,
                before_final_dump=make_dirty,
            )
            pre_pause, pre_total = rp.pause_s, rp.total_frozen_s
        rq = await cp.checkpoint(job, pid, owner_uid=0, owner_gid=0, leave_running=False, pre_copy=0)
        h.wait_exit(pid, 30)
        rr = await cp.restore_latest(job)
        live.append(rr.pid)
        return Row(
            rss_mib=mib,
            image_mib=r.image_bytes / MiB,
            dump_s=r.dump.wall_s,
            pause_s=r.pause_s,
            record_s=record_s,
            precopy_pause_s=pre_pause,
            precopy_total_frozen_s=pre_total,
            preempt_dump_s=rq.dump.wall_s,
            preempt_frozen_s=rq.pause_s,
            preempt_locked=bool(rq.manifest.stats["network_locked"]),
            restore_s=rr.outcome.wall_s,
            verify_s=rr.verify_s,
            copy_gbs=copy_gbs,
        )
    finally:
        for p in live:
            h.kill_tree(p)
        cp.store.delete_job(f"bench-{mib}")


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


HEADER = (
    "job RSS MiB",
    "image MiB",
    "dump s",
    "pause s (full)",
    "pause s (pre-copy)",
    "frozen s (pre-copy, all)",
    "hash+record s",
    "preempt dump s",
    "preempt frozen s",
    "preempt network lock",
    "restore s",
    "verify s",
    "image GB/s",
    "copy GB/s",
    "ratio",
)


def table_rows(rows: list[Row]) -> list[tuple[str, ...]]:
    """Rows of formatted cells, in HEADER order."""
    return [
        (
            str(r.rss_mib),
            f"{r.image_mib:.0f}",
            f"{r.dump_s:.2f}",
            f"{r.pause_s:.3f}",
            _fmt(r.precopy_pause_s, ".3f"),
            _fmt(r.precopy_total_frozen_s, ".3f"),
            f"{r.record_s:.2f}",
            f"{r.preempt_dump_s:.2f}",
            f"{r.preempt_frozen_s:.3f}",
            "yes" if r.preempt_locked else "no",
            f"{r.restore_s:.2f}",
            f"{r.verify_s:.2f}",
            f"{r.throughput_gbs:.2f}",
            f"{r.copy_gbs:.1f}",
            f"{r.ratio:.2f}",
        )
        for r in rows
    ]


def plain_table(rows: list[tuple[str, ...]], header: Sequence[str] = HEADER) -> str:
    """A fixed-width text table."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def markdown_table(rows: list[tuple[str, ...]], header: Sequence[str] = HEADER) -> str:
    """The same table in Markdown, for BENCHMARKS.md."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def print_tables(summary: str, rows: list[tuple[str, ...]], header: Sequence[str]) -> None:
    """Print a benchmark's one-line summary, then its table as text and in Markdown."""
    print(summary)
    print()
    print(plain_table(rows, header))
    print()
    print(markdown_table(rows, header))


def root_scratch(bench: str, base: str, why: str) -> Path:
    """A fresh folder under `base` (mode 0755) for a benchmark that must run as root, else exit 2."""
    if os.geteuid() != 0:
        print(f"{bench}: run as root ({why})", file=sys.stderr)
        raise SystemExit(2)
    folder = Path(tempfile.mkdtemp(prefix=f"sing-{bench.replace('_', '-')}-", dir=base))
    folder.chmod(0o755)
    return folder


async def main_async(args: argparse.Namespace) -> int:
    """Run the benchmark and print both tables."""
    try:
        info = _locate(args.criu)
    except CheckpointUnavailable as e:
        print(f"bench_checkpoint: {e}", file=sys.stderr)
        return 2
    sizes = [100] if args.quick else [int(s) for s in args.sizes.split(",")]
    base = Path(tempfile.mkdtemp(prefix="sing-bench-", dir=args.dir))
    base.chmod(0o755)
    try:
        cp = Checkpointer(Criu(info), ImageStore(base / "store"), keep=3)
        copy_gbs = copy_bandwidth_gbs(256 if args.quick else 1024)
        rows = [await bench_size(cp, base, mib, args.dirty, copy_gbs) for mib in sizes]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    cells = table_rows(rows)
    st = os.statvfs(args.dir or tempfile.gettempdir())
    print(
        f"CRIU {info.version_text} ({info.source}); images in {args.dir or tempfile.gettempdir()}"
        f" ({st.f_bsize}-byte blocks); dirty fraction {args.dirty}; "
        f"memory copy bandwidth {copy_gbs:.1f} GB/s"
    )
    if not info.dirty_tracking:
        print(f"pre-copy: n/a: {info.dirty_tracking_reason}")
    print()
    print(plain_table(cells))
    print()
    print(markdown_table(cells))
    return 0


def main() -> None:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the 100 MB job")
    ap.add_argument("--sizes", default="100,1024,4096", help="job sizes in MiB (comma-separated)")
    ap.add_argument(
        "--dirty",
        type=float,
        default=0.1,
        help="fraction of the buffer rewritten between pre-dump and final dump",
    )
    ap.add_argument("--dir", default="/var/tmp", help="where the images go (a disk, by default)")
    ap.add_argument(
        "--criu",
        default=os.environ.get("SINGULARITYD_TEST_CRIU", "auto"),
        help='CRIU to use: "auto" or a path',
    )
    if os.geteuid() != 0:
        print("bench_checkpoint: run as root (CRIU needs it)", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(asyncio.run(main_async(ap.parse_args())))


if __name__ == "__main__":
    main()
