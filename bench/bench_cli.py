"""CLI benchmark: `sing` start-up, `sing ps` start-to-exit and `sing top` first paint with 1,000 jobs.

A real daemon with one virtual device holds one running job and 999 queued behind it. Each
figure is measured beside references taken in the same run (these machines are shared and
noisy), and the ratios are the result:
- `sing --version` (the CLI's own start-up) against `python -c pass` (the interpreter's);
- `sing ps` and `sing ps -o json` start-to-exit against `sing --version`, and the ListJobs RPC alone;
- `sing top` from process start to the first painted frame with all 1,000 jobs in the table
  (headless, 160x50), against `sing ps`; the app reports when its import finished, when the data
  arrived and when the frame was painted.
It also prints the modules that take longest to import for `sing ps` (python -X importtime).

Run: .venv/bin/python bench/bench_cli.py [--jobs 1000] [--repeat 20]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_foundation import bench_arguments, describe, fill_queue, one_device_daemon, timed  # noqa: E402
from singularityd.api.v1 import singularity_pb2 as pb  # noqa: E402
from tests.helpers import SING  # noqa: E402

FIRST_PAINT = """
import time
started = time.perf_counter()
import json, sys
from pathlib import Path
from singularity.cli.source import DaemonSource
from singularity.cli.top.app import TopApp
imported = time.perf_counter()


class FirstPaint(TopApp):
    def on_refreshed(self, message):
        super().on_refreshed(message)
        if self.refreshes == 1:
            self.data_at = time.perf_counter()
            rows = self.query_one("#jobs").row_count
            self.call_after_refresh(self.report, rows)

    def report(self, rows):
        painted = time.perf_counter()
        print(json.dumps({"import": imported - started, "data": self.data_at - started,
                          "paint": painted - started, "rows": rows}), flush=True)
        self.exit()


FirstPaint(DaemonSource(Path(sys.argv[1])), refresh_seconds=3600).run(headless=True, size=(160, 50))
"""


def top_first_paint(socket: Path, repeat: int) -> tuple[list[float], list[dict[str, float]]]:
    """Wall seconds from spawning the app to its first painted frame, and its own breakdowns."""
    walls, reports = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        process = subprocess.Popen(
            [sys.executable, "-c", FIRST_PAINT, str(socket)], stdout=subprocess.PIPE, text=True
        )
        assert process.stdout is not None
        line = process.stdout.readline()
        walls.append(time.perf_counter() - start)
        process.wait(60)
        reports.append(json.loads(line))
    return walls, reports


def slowest_imports(env: dict[str, str], count: int = 8) -> list[tuple[str, float]]:
    """The top-level imports of `sing ps` that take longest, cumulative ms."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "singularity.cli.main", "ps"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    found = []
    for line in result.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = line.split("|")
        if cumulative.strip().isdigit() and not name.startswith("  "):
            found.append((name.strip(), int(cumulative) / 1000))
    return sorted(found, key=lambda item: -item[1])[:count]


def main() -> None:
    """Measure and print a Markdown table."""
    args = bench_arguments(__doc__.splitlines()[0])
    with one_device_daemon() as (daemon, stub):
        fill_queue(stub, args.jobs)
        env = {**os.environ, "SING_SOCKET": str(daemon.socket)}

        def run(*command: str) -> None:
            """Run a command against the daemon, output discarded."""
            subprocess.run(command, env=env, capture_output=True, check=True)

        interpreter = timed(lambda: run(sys.executable, "-c", "pass"), args.repeat)
        version = timed(lambda: run(SING, "--version"), args.repeat)
        ps = timed(lambda: run(SING, "ps"), args.repeat)
        ps_json = timed(lambda: run(SING, "ps", "-o", "json"), args.repeat)
        rpc = timed(lambda: stub.ListJobs(pb.ListJobsRequest()), args.repeat)
        listed = len(stub.ListJobs(pb.ListJobsRequest()).jobs)
        top, reports = top_first_paint(daemon.socket, max(5, args.repeat // 2))
        imports = slowest_imports(env)
    rows = [
        ("`python -c pass` (interpreter start, reference)", interpreter),
        ("`sing --version` (CLI start)", version),
        (f"`sing ps`, {listed} jobs", ps),
        (f"`sing ps -o json`, {listed} jobs", ps_json),
        (f"ListJobs RPC alone, {listed} jobs (warm client)", rpc),
        (f"`sing top` to first paint, {listed} jobs (headless 160x50)", top),
    ]
    print("| measurement | median ms | p90 ms |")
    print("|---|---:|---:|")
    for label, samples in rows:
        middle, p90 = describe(samples)
        print(f"| {label} | {middle:.1f} | {p90:.1f} |")
    print()
    rows_shown = {int(r["rows"]) for r in reports}
    for part in ("import", "data", "paint"):
        print(f"- top, {part}: {statistics.median(r[part] for r in reports) * 1e3:.0f} ms after start")
    print(f"- top painted {sorted(rows_shown)} job rows")
    median = statistics.median
    print(f"- CLI start / interpreter start: {median(version) / median(interpreter):.2f}x")
    print(f"- `sing ps` / CLI start: {median(ps) / median(version):.2f}x")
    print(f"- `sing top` first paint / `sing ps`: {median(top) / median(ps):.2f}x")
    print(
        "- slowest imports of `sing ps` (cumulative ms): " + ", ".join(f"{n} {ms:.0f}" for n, ms in imports)
    )


if __name__ == "__main__":
    main()
