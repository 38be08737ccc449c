"""Foundation benchmark: submit-to-running latency and `sing ps` latency with 1,000 jobs stored.

Each figure is measured beside a reference taken in the same run on the same machine, and the
ratio is the result (these machines are shared and noisy):
- submit-to-running: from the Submit call until the job's first instruction runs, against
  spawning the same command directly with subprocess;
- first device result: in a job that imports torch, from the end of the import until the first
  result computed on its proxied device (the job's own proxy server, forked for it at admission,
  must be up and connected), against the import itself, timed by the job. torch imports
  torch.distributed.tensor at the first operation on any tensor subclass, the proxy's stand-ins
  included; the job imports it beforehand so that this cost, torch's, is shown on its own line;
- `sing ps` with 1,000 queued jobs: the whole CLI invocation, against `sing --help` (the cost
  of starting the CLI at all), and the ListJobs RPC alone from a warm client.

Run: .venv/bin/python bench/bench_foundation.py [--jobs 1000] [--repeat 20]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from singularityd.api.v1 import singularity_pb2 as pb  # noqa: E402
from singularityd.api.v1 import singularity_pb2_grpc as pb_grpc  # noqa: E402
from tests.helpers import SING, Daemon  # noqa: E402

STAMP = "date +%s.%N"
FIRST_DEVICE_RESULT = (
    "import time; started = time.perf_counter(); import torch; imported = time.perf_counter(); "
    "import torch.distributed.tensor; subclass_ready = time.perf_counter(); "
    "torch.ones(4, device='cuda').add(1).sum().item(); done = time.perf_counter(); "
    "print(imported - started, subclass_ready - imported, done - subclass_ready)"
)


def timed(action: Callable[[], object], repeat: int) -> list[float]:
    """Wall-clock seconds of each of `repeat` runs of the action."""
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        action()
        samples.append(time.perf_counter() - start)
    return samples


def submit_to_running(stub: pb_grpc.SingularityStub, daemon: Daemon, repeat: int) -> list[float]:
    """Seconds from calling Submit until the job's command printed its first timestamp."""
    samples = []
    for _ in range(repeat):
        started = time.time()
        job = stub.Submit(
            pb.SubmitRequest(command=["sh", "-c", STAMP], cwd="/tmp", env={"PATH": os.environ["PATH"]})
        ).job
        stub.Wait(pb.JobRef(id=job.id))
        log = daemon.state_dir / "jobs" / str(job.id) / "logs" / "rank-0.log"
        samples.append(float(log.read_text().split()[0]) - started)
    return samples


def direct_spawn(repeat: int) -> list[float]:
    """Seconds from spawning the same command directly until it printed its timestamp."""
    samples = []
    for _ in range(repeat):
        started = time.time()
        out = subprocess.run(["sh", "-c", STAMP], capture_output=True, text=True, check=True).stdout
        samples.append(float(out.split()[0]) - started)
    return samples


def first_device_result(
    stub: pb_grpc.SingularityStub, daemon: Daemon, repeat: int
) -> tuple[list[float], list[float], list[float]]:
    """Seconds each proxied job took, by its own clock, to import torch, to import what torch loads
    at the first operation on a tensor subclass, and then to get its first result from its device."""
    imports, subclass_imports, firsts = [], [], []
    for _ in range(repeat):
        job = stub.Submit(
            pb.SubmitRequest(
                command=[sys.executable, "-c", FIRST_DEVICE_RESULT],
                cwd="/tmp",
                env={"PATH": os.environ["PATH"]},
            )
        ).job
        stub.Wait(pb.JobRef(id=job.id))
        log = daemon.state_dir / "jobs" / str(job.id) / "logs" / "rank-0.log"
        imported, subclass_ready, first = (float(field) for field in log.read_text().split()[-3:])
        imports.append(imported)
        subclass_imports.append(subclass_ready)
        firsts.append(first)
    return imports, subclass_imports, firsts


def fill_queue(stub: pb_grpc.SingularityStub, count: int) -> None:
    """One job holding the only device, then `count - 1` jobs queued behind it."""
    env = {"PATH": os.environ["PATH"]}
    stub.Submit(pb.SubmitRequest(command=["sleep", "3600"], cwd="/tmp", env=env))
    for index in range(count - 1):
        stub.Submit(pb.SubmitRequest(command=["true"], name=f"queued-{index}", cwd="/tmp", env=env))


def describe(samples: list[float]) -> tuple[float, float]:
    """Median and 90th percentile, in milliseconds."""
    ordered = sorted(samples)
    return statistics.median(ordered) * 1e3, ordered[int(0.9 * (len(ordered) - 1))] * 1e3


@contextlib.contextmanager
def one_device_daemon() -> Iterator[tuple[Daemon, pb_grpc.SingularityStub]]:
    """A daemon with one virtual device in a temporary folder and a client stub; at the end its
    jobs are killed and it stops."""
    with tempfile.TemporaryDirectory(prefix="sing-bench-", dir="/tmp") as root:
        daemon = Daemon(Path(root), virtual_devices=1)
        daemon.start()
        channel = grpc.insecure_channel(f"unix:{daemon.socket}")
        try:
            yield daemon, pb_grpc.SingularityStub(channel)
        finally:
            channel.close()
            for pid_file in (daemon.state_dir / "jobs").glob("*/init.pid"):
                subprocess.run(["kill", "-9", pid_file.read_text().split()[0]], capture_output=True)
            daemon.stop()


def bench_arguments(description: str) -> argparse.Namespace:
    """--jobs (queued for the listing measurements) and --repeat (runs of each measurement)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=20)
    return parser.parse_args()


def main() -> None:
    """Run both measurements and print a Markdown table."""
    args = bench_arguments(__doc__.splitlines()[0])
    with one_device_daemon() as (daemon, stub):
        latency = submit_to_running(stub, daemon, args.repeat)
        reference = direct_spawn(args.repeat)
        torch_import, dtensor_import, first_result = first_device_result(stub, daemon, args.repeat)
        fill_queue(stub, args.jobs)
        env = {**os.environ, "SING_SOCKET": str(daemon.socket)}
        ps = timed(
            lambda: subprocess.run([SING, "ps"], env=env, capture_output=True, check=True), args.repeat
        )
        cli_start = timed(
            lambda: subprocess.run([SING, "--help"], env=env, capture_output=True, check=True),
            args.repeat,
        )
        rpc = timed(lambda: stub.ListJobs(pb.ListJobsRequest()), args.repeat)
        listed = len(stub.ListJobs(pb.ListJobsRequest()).jobs)
    rows = [
        ("submit-to-running (singularityd)", latency, None),
        ("spawn the same command directly (reference)", reference, None),
        ("first device result after `import torch`, in the job", first_result, None),
        ("`import torch`, in the same jobs (reference)", torch_import, None),
        ("`import torch.distributed.tensor` after it, in the same jobs", dtensor_import, None),
        (f"`sing ps`, {listed} jobs queued", ps, None),
        ("`sing --help` (CLI start, reference)", cli_start, None),
        (f"ListJobs RPC alone, {listed} jobs", rpc, None),
    ]
    print(f"| measurement ({args.repeat} runs) | median ms | p90 ms |")
    print("|---|---:|---:|")
    for label, samples, _ in rows:
        median, p90 = describe(samples)
        print(f"| {label} | {median:.1f} | {p90:.1f} |")
    print()
    print(
        f"submit-to-running / direct spawn: {statistics.median(latency) / statistics.median(reference):.1f}x"
    )
    print(
        "first device result / import torch: "
        f"{statistics.median(first_result) / statistics.median(torch_import):.2f}x"
    )
    print(
        f"`sing ps` ({listed} jobs) / CLI start: {statistics.median(ps) / statistics.median(cli_start):.2f}x"
    )


if __name__ == "__main__":
    main()
