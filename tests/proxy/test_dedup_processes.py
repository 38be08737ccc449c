"""Replica splicing's memory with real server processes and torch programs: 4 DDP ranks spliced
on one device train to the bits of 4 devices, using at most 1.5x the device memory of one rank
alone after the step (their updates squashed, squash.py, the peak bounded too), and are judged
replicas; ranks with different weights are judged not replicas, with the reason, and compute their
own updates; a spliced job preempted and resumed through the daemon is exact. The same mechanisms
on a Server object in this process: test_dedup.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from singularity.proxy.control import ProxyControl, splice_refusal
from tests.conftest import requires_root
from tests.helpers import Daemon, preempt_while_training, running_daemon, wait_until
from tests.proxy.conftest import (
    PYTHON,
    ProxyServer,
    communicate_all,
    start_linked_servers,
    start_ranks,
    stop_server,
)
from tests.test_collectives import JOB_OPTIONS, printed, succeeded

JOB = "job"


@pytest.fixture
def started() -> Iterator[list[ProxyServer]]:
    """Servers the test starts (stopped at the end)."""
    servers: list[ProxyServer] = []
    yield servers
    for server in servers:
        stop_server(server)


class Held:
    """A job's ranks run up to the hold after their last step; then the test lets them end."""

    def __init__(self, folder: Path, servers: list[ProxyServer], ranks: int, args: Sequence[str]) -> None:
        folder.mkdir()
        self.folder = folder
        self.servers = servers
        self.release = folder / "release"
        ready = str(folder / "ready-")
        command = ["splice_train.py", *args, "--hold", str(self.release), "--ready", ready]
        self.processes = start_ranks(command, ranks, [s.socket for s in servers])
        self.ready = [Path(f"{ready}{rank}") for rank in range(ranks)]

    def wait_trained(self) -> None:
        """Wait until every rank is past its last step and the barrier after it."""

        def trained() -> bool:
            failed = [p for p in self.processes if p.poll() is not None]
            assert not failed, [p.communicate()[1][-3000:] for p in failed]
            return all(path.exists() for path in self.ready)

        wait_until(trained, timeout=600, interval=0.2)

    def finish(self) -> list[str]:
        """Let the ranks end; each one's stdout."""
        self.release.touch()
        outputs = communicate_all(self.processes, 600)
        assert [p.returncode for p in self.processes] == [0] * len(self.processes), [
            err[-3000:] for _, err in outputs
        ]
        return [out for out, _ in outputs]


def held_job(
    started: list[ProxyServer],
    tmp: Path,
    devices: int,
    ranks: int,
    args: Sequence[str],
    options: Sequence[str] = (),
) -> Held:
    """Start a job of `ranks` ranks on `devices` linked servers (with these server options) and
    wait until it is trained."""
    where = tmp / f"servers-{len(started)}"
    where.mkdir()
    servers = start_linked_servers(where, devices, options=options)
    job = Held(tmp / f"job-{len(started)}", servers, ranks, args)
    started.extend(servers)
    job.wait_trained()
    return job


def server_status(server: ProxyServer) -> dict[str, Any]:
    """The server's status (its memory figures among them)."""
    with ProxyControl(server.control) as control:
        return dict(control.status())


def allocated(server: ProxyServer) -> int:
    """The server's own count of its live storage bytes."""
    return int(server_status(server)["allocated"])


def peak(server: ProxyServer) -> int:
    """The most live storage bytes the server held at once."""
    return int(server_status(server)["peak"])


def replicas(server: ProxyServer) -> dict[str, Any]:
    with ProxyControl(server.control) as control:
        return control.replicas(JOB)


MODEL = ["--width", "256", "--layers", "4", "--steps", "5"]
"""Parameters and Adam state of about 3 MiB against a few KiB of activations."""
PEAK_RATIO = 1.6
"""The most 4 spliced ranks hold at once against 1 rank alone. One rank alone peaks at about 5 P
(P: the parameters' bytes; parameters, gradients, DDP bucket, Adam's two states). Spliced, the
ranks take turns up to their collectives and wait there with what they alone hold in host
memory, and they update what they share a few operations apart (pace.py): 3 P shared plus about
one rank's own gradients and bucket, 1.32x-1.41x measured on a quiet machine (2.2x-2.6x before
the turns). The room above the issue's 1.5x is for a loaded machine."""
TURN_GRACE = ["--turn-grace", "0.05"]
"""The server option the spliced run takes: with the default grace (1 ms), a rank whose process is
off the CPU for longer loses its turn, and two ranks hold their gradients at once; on a loaded
machine (the suite's workers, or two busy loops beside this test on 2 cores) the peak was then
1.61x-1.92x. The test is of what the turns hold, so its ranks keep their turns through such
pauses; bench_splice.py measures the default."""


@pytest.mark.timeout(900)
def test_four_spliced_replicas_train_like_four_devices_in_one_model_of_memory(
    started: list[ProxyServer], tmp_path: Path
) -> None:
    """4 DDP ranks on 1 device print what they print on 4 devices, bit for bit; the device holds at
    most 1.5x what 1 rank alone holds after the step, and at most PEAK_RATIO during it, their
    updates squashed (run once) and their waits in host memory; the server judges the ranks
    data-parallel replicas."""
    alone = held_job(started, tmp_path, 1, 1, MODEL)
    alone_bytes = allocated(alone.servers[0])
    alone_peak = peak(alone.servers[0])
    assert replicas(alone.servers[0])["replicas"] == "unknown"
    alone.finish()

    spliced = held_job(started, tmp_path, 1, 4, MODEL, TURN_GRACE)
    spliced_bytes = allocated(spliced.servers[0])  # as the collectives left it, before any request
    spliced_peak = peak(spliced.servers[0])
    swapped = server_status(spliced.servers[0])["swapped_total"]
    summary = replicas(spliced.servers[0])
    spliced_out = spliced.finish()

    assert spliced_bytes <= 1.5 * alone_bytes, (spliced_bytes, alone_bytes, summary)
    assert summary["replicas"] == "yes", summary
    assert summary["device_bytes"] <= 1.5 * alone_bytes, summary
    assert splice_refusal([summary]) == ""
    assert summary["squashed"] > 0, summary
    assert spliced_peak <= PEAK_RATIO * alone_peak, (spliced_peak, alone_peak, summary)
    assert swapped > 0, "the waiting ranks' storages were moved to host memory"

    side_by_side = held_job(started, tmp_path, 1, 4, MODEL, ["--no-splice-lean"])
    side_by_side_peak = peak(side_by_side.servers[0])
    assert server_status(side_by_side.servers[0])["swapped_total"] == 0
    assert side_by_side.finish() == spliced_out
    assert spliced_peak < side_by_side_peak, (spliced_peak, side_by_side_peak, "splice_lean false")

    spread = held_job(started, tmp_path, 4, 4, MODEL)
    assert all(replicas(s)["replicas"] == "unknown" for s in spread.servers), "one rank per device"
    assert spliced_out == spread.finish()
    assert all(f"rank {r} final " in out for r, out in enumerate(spliced_out))


@pytest.mark.timeout(600)
def test_ranks_with_different_weights_are_not_replicas(started: list[ProxyServer], tmp_path: Path) -> None:
    """2 ranks that train their own weights on one device: the server says they are not replicas,
    naming them, and the daemon's check refuses splicing with that reason. Each computes its own
    updates (nothing squashed) and prints what it prints on a device of its own."""
    job = held_job(started, tmp_path, 1, 2, [*MODEL, "--different"])
    summary = replicas(job.servers[0])
    spliced_out = job.finish()
    assert (summary["squashed"], summary["near_hits"]) == (0, 0), summary
    spread = held_job(started, tmp_path, 2, 2, [*MODEL, "--different"])
    assert spliced_out == spread.finish()
    assert summary["replicas"] == "no", summary
    reason = str(summary["reason"])
    assert reason.startswith("ranks 0 and 1 hold different parameters: not data-parallel replicas"), reason
    assert splice_refusal([summary]) == reason


def device_control(daemon: Daemon, job: int) -> Path:
    """The daemon's control socket of the job's server on its one device."""
    found = sorted(daemon.state_dir.glob(f"proxy/control/job-{job}-dev-*.sock"))
    assert len(found) == 1, found
    return found[0]


def shared_now(daemon: Daemon, job: int) -> int:
    """Bytes the job's ranks share on its device now (what they hold alike shared first)."""
    with ProxyControl(device_control(daemon, job)) as control:
        return int(control.replicas(str(job))["shared_bytes"])


@requires_root
@pytest.mark.timeout(1800)
def test_a_spliced_job_preempted_and_resumed_is_exact(daemon_root: Path) -> None:
    """4 ranks spliced on 1 device (through the daemon, --gpus 1), preempted and resumed 3 times
    (the quiesce shares what the replicas hold alike, the save holds it once): every rank prints
    what an uninterrupted run on 4 devices prints."""
    total, ranks = 30, 4
    args = [*MODEL[:-1], str(total), "--sleep", "0.05"]
    options = [*JOB_OPTIONS, "--ranks", str(ranks)]
    release = daemon_root / "release"
    with running_daemon(daemon_root, virtual_devices=ranks) as daemon:
        uninterrupted = daemon.submit(PYTHON, "splice_train.py", *args, options=[*options, "--gpus", "4"])
        expected = printed(succeeded(daemon, uninterrupted, ranks))
        job = daemon.submit(
            PYTHON, "splice_train.py", *args, "--hold", str(release), options=[*options, "--gpus", "1"]
        )
        daemon.wait_state(job, "RUNNING")

        def restored_server_answers() -> None:
            """The restored server answers for the job."""
            assert shared_now(daemon, job) >= 0

        preempt_while_training(daemon, job, ranks, total, 3, wait_timeout=600, after=restored_server_answers)
        release.touch()
        assert printed(succeeded(daemon, job, ranks, timeout=600)) == expected
        reasons = [e["reason"] for e in daemon.job(job)["events"]]
        assert sum(r.startswith("restored from checkpoint") for r in reasons) == 3
