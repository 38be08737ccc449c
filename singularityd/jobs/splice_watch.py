"""Watching spliced jobs: the daemon asks their proxy servers whether the ranks sharing a device
are data-parallel replicas, and stops splicing a job whose ranks are not.

Every `splice_verdict_seconds` (a daemon setting, singularityd/config.py), each running job with
more ranks than devices and nothing under way has its servers asked for the verdict they keep
from its collectives (proxy/server/dedup.py): a status read, no comparison, the job does not
stop. A server says "no" after a few rounds of collectives (3 per device). Then the job is marked
with the servers' reason and an event says what follows (scheduling/replicas.py decides): resized
to one device per rank when that many are free counting its own, else checkpointed and queued
until they are, the reason in its pending reason. A marked job whose stop fails (a checkpoint
error) is tried again after `RETRY_SECONDS`. "yes" and "unknown" change nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from singularity.proxy.control import splice_refusal
from singularityd.checkpoint.interface import CheckpointTaken
from singularityd.core.actions import TakeCheckpoint
from singularityd.core.states import InvalidTransition, JobState
from singularityd.core.stimuli import PreemptRequested, ResizeRequested
from singularityd.devices.access import DeviceError
from singularityd.devices.splicing import spliced
from singularityd.scheduling.replicas import unsplice, wants_verdict
from singularityd.store import JobRecord

if TYPE_CHECKING:
    from singularityd.daemon import Daemon

log = logging.getLogger("singularityd")

RETRY_SECONDS = 60.0
"""How long after a failed stop a refused job still spliced is tried again."""
REFUSED_BY = "the daemon (its ranks are not data-parallel replicas)"


class SpliceWatch:
    """Asks the servers of spliced jobs for their verdict and stops splicing the refused ones."""

    def __init__(self, daemon: Daemon, every: float | None = None) -> None:
        self.daemon = daemon
        self.every = every
        """Seconds between looks; None: the daemon's splice_verdict_seconds, as it is at each look
        (a reloaded config applies from the next one)."""
        self.retry_at: dict[int, float] = {}
        """Job -> when (time.monotonic) a refused job whose stop failed may be tried again."""

    async def run(self) -> None:
        """Check every `every` seconds until cancelled (the daemon stops)."""
        while True:
            await asyncio.sleep(self.every or self.daemon.config.splice_verdict_seconds)
            try:
                await self.check()
            except Exception:
                log.exception("checking whether spliced jobs' ranks are replicas failed")

    async def check(self) -> None:
        """One look at every running job: ask the servers of spliced ones, act on a refusal."""
        daemon = self.daemon
        running = daemon.store.list_jobs(states=(JobState.RUNNING,))
        self.retry_at = {job.id: self.retry_at[job.id] for job in running if job.id in self.retry_at}
        for job in running:
            ranks, held = job.spec.ranks, len(job.devices)
            idle = daemon.activity(job.id).idle
            if job.splice_refusal:
                due = time.monotonic() >= self.retry_at.get(job.id, 0.0)
                if idle and due and spliced(ranks, held):
                    self._stop_splicing(job)
                continue
            if not wants_verdict(ranks, held, job.splice_refusal, idle):
                continue
            try:
                summaries = await daemon.devices.verdicts(job.id, job.devices)
            except DeviceError as error:
                log.debug("job %d: no splicing verdict: %s", job.id, error)
                continue
            refusal = splice_refusal(summaries)
            current = daemon.store.get(job.id)
            if not refusal or current is None or current.state is not JobState.RUNNING:
                continue
            if not daemon.activity(job.id).idle:
                continue  # a checkpoint began meanwhile: asked again once it is over
            daemon.store.set_splice_refusal(job.id, refusal)
            plan = unsplice(ranks, len(current.devices), len(daemon.cluster_view().free_devices))
            text = plan.describe(refusal)
            daemon.store.add_note(job.id, current.state, text, daemon.clock())
            log.info("job %d: %s", job.id, text)
            self._stop_splicing(daemon.get_job(job.id))

    def _stop_splicing(self, job: JobRecord) -> None:
        """Resize the refused job to one device per rank if enough are free, else checkpoint it
        and queue it for them; from now on it asks for one device per rank. A stop that cannot
        start now, or fails, is tried again later."""
        daemon = self.daemon
        ranks = job.spec.ranks
        plan = unsplice(ranks, len(job.devices), len(daemon.cluster_view().free_devices))
        stimulus = ResizeRequested(REFUSED_BY, ranks) if plan.now else PreemptRequested(REFUSED_BY)
        try:
            decision = daemon.apply(job.id, stimulus)
        except InvalidTransition as error:
            log.info("job %d: splicing not stopped yet: %s", job.id, error)
            self.retry_at[job.id] = time.monotonic() + RETRY_SECONDS
            return
        daemon.store.set_gpus(job.id, ranks)
        record = daemon.records.get(job.id)
        outcome = record.checkpoint_outcome if record is not None else None
        if outcome is not None and any(isinstance(action, TakeCheckpoint) for action in decision.actions):
            daemon.spawn(self._follow(job.id, outcome))

    async def _follow(self, job_id: int, outcome: asyncio.Future[CheckpointTaken]) -> None:
        """The stop to its end; a failed one (the job runs on spliced) is tried again later."""
        try:
            await asyncio.shield(outcome)
        except Exception as error:
            log.warning("job %d: stopping its splicing failed: %s", job_id, error)
            self.retry_at[job_id] = time.monotonic() + RETRY_SECONDS
        else:
            self.retry_at.pop(job_id, None)
