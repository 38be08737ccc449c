"""The daemon acting on its proxy servers' splicing verdict: the real Daemon, store, state machine
and SpliceWatch, with the orchestration tests' fakes for processes, checkpoints and devices (whose
verdict the test sets). Milliseconds each; tests/test_splice_refusal.py does it for real."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from singularityd.api.service import job_message
from singularityd.config import Config
from singularityd.core.states import JobState
from singularityd.daemon import Daemon
from singularityd.devices.inventory import Inventory, virtual_devices
from singularityd.errors import InvalidRequest
from singularityd.jobs.splice_watch import SpliceWatch
from singularityd.jobs.submission import SubmitArgs
from singularityd.requests import Requests
from singularityd.store import Store
from tests.test_orchestration import (
    ROOT,
    Clock,
    FakeCheckpoints,
    FakeDevices,
    FakeProcesses,
    Harness,
    settle,
)

NO = {"replicas": "no", "reason": "ranks 0 and 1 hold different parameters: not data-parallel replicas"}


@pytest.fixture
async def two_devices(tmp_path: Path) -> AsyncIterator[Harness]:
    """A daemon on fakes with 2 devices."""
    config = Config(socket=tmp_path / "sing.sock", state_dir=tmp_path)
    processes, checkpoints, devices = FakeProcesses(tmp_path / "jobs"), FakeCheckpoints(), FakeDevices()
    store = Store(tmp_path / "singularity.db")
    clock = Clock()
    inventory = Inventory(virtual_devices(2, 1.0), "not used")
    daemon = Daemon(config, store, inventory, processes, checkpoints, devices, clock)  # type: ignore[arg-type]
    await daemon.start()
    yield Harness(
        daemon, Requests(daemon, launch_wait_seconds=0.05), processes, checkpoints, devices, clock, "/"
    )
    await daemon.stop()


async def spliced_job(h: Harness, ranks: int = 2, gpus: int = 1, min_gpus: int = 0, max_gpus: int = 0) -> int:
    """A running job of `ranks` ranks on `gpus` devices (elastic within min_gpus-max_gpus when given)."""
    args = SubmitArgs(("train",), "", gpus, 0, ranks, "/", {}, min_gpus=min_gpus, max_gpus=max_gpus)
    job = h.requests.submit(ROOT, args).id
    await settle()
    assert h.job(job).state is JobState.RUNNING and len(h.job(job).devices) == gpus
    return job


async def test_replicas_or_an_unknown_verdict_keep_splicing(two_devices: Harness) -> None:
    """ "yes" and "unknown" change nothing; a job with a device per rank is not even asked."""
    h = two_devices
    job = await spliced_job(h)
    for verdict in (
        {"replicas": "unknown", "reason": "1 of 3 rounds"},
        {"replicas": "yes", "reason": "same"},
    ):
        h.devices.verdict = verdict
        await SpliceWatch(h.daemon).check()
        await settle()
        assert h.job(job).state is JobState.RUNNING and h.job(job).splice_refusal == ""
    assert h.checkpoints.taken == [] and h.devices.calls.count(("verdicts", job)) == 2
    spread = await spliced_job(h, ranks=1, gpus=1)
    await SpliceWatch(h.daemon).check()
    assert ("verdicts", spread) not in h.devices.calls


async def test_not_replicas_with_a_device_free_are_resized_to_one_device_per_rank(
    two_devices: Harness,
) -> None:
    """The job is marked, the event gives the servers' reason, the resize runs, and a resize back
    below its ranks is refused with the reason."""
    h = two_devices
    job = await spliced_job(h)
    h.devices.verdict = NO
    await SpliceWatch(h.daemon).check()
    await settle()
    assert h.job(job).splice_refusal == NO["reason"]
    assert h.job(job).state is JobState.RUNNING and h.job(job).devices == (0, 1) and h.job(job).spec.gpus == 2
    reasons = h.reasons(job)
    assert f"splicing refused: {NO['reason']}; resizing it to 2 devices, one per rank" in reasons
    assert any(
        r.startswith("resized to 2 devices by the daemon (its ranks are not data-parallel") for r in reasons
    )
    with pytest.raises(InvalidRequest, match="need one device each"):
        await h.requests.resize(ROOT, job, 1)
    await SpliceWatch(h.daemon).check()
    assert h.devices.calls.count(("verdicts", job)) == 1, "a job on one device per rank is not asked again"


async def test_not_replicas_without_a_device_free_wait_for_one_per_rank(two_devices: Harness) -> None:
    """With the other device taken the job is checkpointed and waits, saying why; it starts on 2
    devices once the other job ends."""
    h = two_devices
    other = await spliced_job(h, ranks=1, gpus=1)
    job = await spliced_job(h)
    h.devices.verdict = NO
    await SpliceWatch(h.daemon).check()
    await settle()
    assert h.job(job).state is JobState.PREEMPTED and h.job(job).spec.gpus == 2
    assert h.job(job).pending_reason == f"Resources: needs 2 devices, 1 free (one per rank: {NO['reason']})"
    assert f"splicing refused: {NO['reason']}; checkpointing it until 2 devices, one per rank, are free" in (
        h.reasons(job)
    )
    h.processes.end(h.pid(other), other, exit_code=0)
    await settle()
    assert h.job(job).state is JobState.RUNNING and h.job(job).devices == (0, 1)


async def refused_while_stopping(h: Harness) -> tuple[int, SpliceWatch, asyncio.Future[str]]:
    """A spliced job refused by its servers, whose stop's checkpoint waits for the returned gate."""
    job = await spliced_job(h)
    h.devices.verdict = NO
    watch = SpliceWatch(h.daemon)
    gate = h.checkpoints.hold()
    await watch.check()
    await settle()
    return job, watch, gate


async def test_a_refused_job_whose_stop_fails_is_tried_again(two_devices: Harness) -> None:
    """A failed checkpoint leaves the job running spliced, marked and asking for 2 devices; the next
    try after the wait stops it."""
    h = two_devices
    job, watch, gate = await refused_while_stopping(h)
    gate.set_result("No space left on device")
    await settle()
    assert h.job(job).state is JobState.RUNNING and h.job(job).devices == (0,) and h.job(job).spec.gpus == 2
    assert job in watch.retry_at
    await watch.check()
    assert len(h.checkpoints.taken) == 1, "not before the retry is due"
    h.checkpoints.gate = None
    watch.retry_at[job] = 0.0
    await watch.check()
    await settle()
    assert h.job(job).state is JobState.RUNNING and h.job(job).devices == (0, 1)


async def test_a_refused_job_that_ends_during_its_stop_ends_as_its_exit_says(two_devices: Harness) -> None:
    """The job's processes end while the resize's checkpoint is under way and the checkpoint then
    fails (its proxies have nothing of the job left): no failed checkpoint is reported, the job
    completes as its exit says."""
    h = two_devices
    job, _watch, gate = await refused_while_stopping(h)
    h.processes.end(h.pid(job), job, exit_code=0)
    await settle()
    assert h.job(job).state is JobState.RUNNING, "the exit waits for the checkpoint under way"
    gate.set_result("proxy: job 1 has nothing on device 0")
    await settle()
    assert h.job(job).state is JobState.COMPLETED
    reasons = h.reasons(job)
    assert not [r for r in reasons if "checkpoint failed" in r or "KeyError" in r], reasons
    assert any(
        r.startswith("the job ended during its checkpoint (resized to 2 devices by the daemon")
        for r in reasons
    ), reasons


async def test_an_elastic_job_refused_splicing_shows_the_range_the_scheduler_applies(
    two_devices: Harness,
) -> None:
    """Submitted elastic 1-2 with 2 ranks, refused splicing: `sing show` and `sing ps` get 2-2
    (what the scheduler may use), not the 1-2 it was submitted with."""
    h = two_devices
    job = await spliced_job(h, gpus=1, min_gpus=1, max_gpus=2)
    shown = job_message(h.job(job), h.requests)
    assert (shown.min_gpus, shown.max_gpus) == (1, 2)
    h.devices.verdict = NO
    await SpliceWatch(h.daemon).check()
    await settle()
    assert h.job(job).splice_refusal == NO["reason"] and h.job(job).devices == (0, 1)
    shown = job_message(h.job(job), h.requests)
    assert (shown.min_gpus, shown.max_gpus) == (2, 2) and shown.splice_refusal == NO["reason"]
