"""The daemon's side of a move (driver.MoveWork): the hand-off's actions carried out on real jobs.

This module is the source side: `stop_for_move` asks the job state machine to checkpoint and stop
the job (RUNNING -> MIGRATING; a queued job is just set aside), sending while it still runs what it
can (the pre-copied device state, a base of its process images: see `bases`), `send_checkpoint`
streams the checkpoint folder, the logs and the job's record to the peer, `drop_local_copy` marks
the job MOVED once the peer holds it, `resume_here` queues it here again when the move is
abandoned. The target side (PREPARE's checks, the restore frozen, its release or discard) is
`arrivals.Arrivals`, whose methods `DaemonMoves` hands the driver with its own.
Every method is idempotent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from singularityd.checkpoint.coordinator import JobCheckpoints
from singularityd.checkpoint.errors import CheckpointError
from singularityd.checkpoint.interface import PauseHooks
from singularityd.checkpoint.manifest import MANIFEST_NAME, parse_seq_dir_name
from singularityd.checkpoint.store import ImageStore
from singularityd.core.actions import TakeCheckpoint
from singularityd.core.decisions import StillLaunching
from singularityd.core.states import InvalidTransition, JobState
from singularityd.core.stimuli import MovedAway, MoveStopRequested
from singularityd.daemon import Daemon
from singularityd.errors import RequestError
from singularityd.federation import bases, jobfiles
from singularityd.federation.arrivals import Arrivals
from singularityd.federation.facts import MoveFacts
from singularityd.federation.handoff import Holding
from singularityd.federation.holdings import StoredHoldings
from singularityd.federation.hosting import MoveSpec, probe_cwd
from singularityd.federation.pagedelta import DeltaError
from singularityd.federation.peer import PeerChannels
from singularityd.federation.transfer import MiB, Progress, Source, TransferError, adopt_digests
from singularityd.federation.transfer_grpc import Sending
from singularityd.units import human_bytes

CHUNK_BYTES = 4 * MiB
SEND_ATTEMPTS = 30
SEND_PAUSE_S = 1.0
PEER_CHECK_S = 5.0
"""How long the target has to answer a health check before a job stops for a move to it."""
SEND_PATIENCE_S = 10.0
"""A target silent this long after the job stopped is given up on, and the job runs here again."""
LAUNCH_WAIT_S = 120.0

log = logging.getLogger(__name__)


def early_folder(staging: Path) -> Path:
    """Where the recipes of the process images staged in `staging` are made once CRIU returned."""
    return staging.with_name(f"{staging.name}.early")


def newest_complete_seq(images: ImageStore, job: str) -> int | None:
    """The seq of the job's newest checkpoint with a manifest, or None."""
    for seq in reversed(images.seqs(job)):
        if (images.checkpoint_dir(job, seq) / MANIFEST_NAME).exists():
            return seq
    return None


class DaemonMoves:
    """Carries out the hand-off's actions on the daemon's jobs (driver.MoveWork): those of a source
    here, those of a target through `arrivals`."""

    def __init__(
        self,
        daemon: Daemon,
        holdings: StoredHoldings,
        channels: PeerChannels,
        address_of: Callable[[str], str],
        arrivals: Arrivals,
        *,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.daemon = daemon
        self.holdings = holdings
        self.channels = channels
        self.address_of = address_of
        self.arrivals = arrivals
        self.images = arrivals.images
        """The daemon's image store (where checkpoints live), the one its arrivals use."""
        self.chunk_bytes = chunk_bytes
        self.transfers: dict[int, Progress] = {}
        """The transfer of each job on its way out, as its sender last reported it."""
        self.placing: set[int] = set()
        """Jobs moved only because they could not start here: not to be stopped if they start."""
        self.pre_sent: dict[int, Source] = {}
        """Per job on its way out: what was sent of its device state while it still ran."""
        self.bases: dict[int, bases.ProcessBase] = {}
        """Per job on its way out: the base of its process images sent while it still ran."""
        self.early: dict[int, asyncio.Future[dict[str, bases.EarlyDelta]]] = {}
        """Per job on its way out: the recipes of its final dump's images, begun once CRIU returned."""

    # Places

    def outgoing(self, job_id: str, epoch: int) -> Path:
        """Where the files of a leaving job are staged (hard links) for one epoch."""
        return self.daemon.config.checkpoints / jobfiles.OUTGOING_DIR / f"{job_id}@{epoch}"

    def facts(self, job_id: int) -> MoveFacts | None:
        """The move of this job away from here, while one is under way."""
        holding = self.holdings.load(str(job_id))
        if holding is None or not holding.owns or holding.phase.value == "owned":
            return None
        phase = {
            "out-preparing": "preparing",
            "out-transferring": "stopping",
            "out-restoring": "restoring",
            "out-committed": "committing",
        }[holding.phase.value]
        progress = self.transfers.get(job_id)
        if progress is None:
            return MoveFacts(holding.peer, phase)
        if phase == "stopping" and progress.phase != "done":
            phase = "sending"
        return MoveFacts(holding.peer, phase, progress.moved, progress.total, progress.sent)

    # Source side

    def spec_json(self, job_id: str) -> bytes:
        """What the target checks at PREPARE (see hosting.MoveSpec)."""
        job = self.daemon.get_job(int(job_id))
        _, checkpoint_bytes = self.daemon.checkpoints.usage(job.id)
        spec = MoveSpec(
            job_id=job_id,
            user=job.spec.user,
            uid=job.spec.uid,
            cwd=job.spec.cwd,
            gpus=job.spec.gpus,
            ranks=job.spec.ranks,
            checkpoint_bytes=checkpoint_bytes,
            cwd_entries=probe_cwd(job.spec.cwd),
            jobs_dir=str(self.daemon.config.jobs_dir),
        )
        return spec.to_json()

    async def stop_for_move(self, job_id: str, epoch: int) -> None:
        """Checkpoint and stop the job for the move (RUNNING -> MIGRATING); queued jobs are set aside."""
        job_number = int(job_id)
        holding = self.holdings.load(job_id)
        peer = holding.peer if holding is not None else "a peer"
        daemon = self.daemon
        daemon.move_pause_hooks[job_number] = PauseHooks(
            before_pause=partial(self._pre_send, job_id, peer, epoch),
            once_dumped=partial(self._begin_early_deltas, job_id, epoch),
        )
        try:
            await self._stop(job_number, peer)
        finally:
            daemon.move_pause_hooks.pop(job_number, None)

    async def _stop(self, job_number: int, peer: str) -> None:
        """Have the state machine stop the job with a checkpoint for the move (see stop_for_move)."""
        job_id, daemon = str(job_number), self.daemon
        while True:
            job = daemon.get_job(job_number)
            if job.state is JobState.MIGRATING:
                return
            if job.state is JobState.RUNNING and job_number in self.placing:
                raise RuntimeError(f"job {job_id} started here meanwhile; it stays")
            if daemon.activity(job_number).checkpoint is not None:
                await daemon.checkpoint_settled(job_number)  # a periodic one: wait for it
                await asyncio.sleep(0.05)
                continue
            try:
                decision = daemon.apply(job_number, MoveStopRequested(peer))
            except StillLaunching:
                await daemon.launched(job_number, LAUNCH_WAIT_S)
                continue
            except InvalidTransition as error:
                raise RuntimeError(str(error)) from None
            if any(isinstance(action, TakeCheckpoint) for action in decision.actions):
                try:
                    await daemon.checkpoint_outcome(job_number)
                except RequestError as error:
                    raise RuntimeError(error.message) from None
            state = daemon.get_job(job_number).state
            if state is not JobState.MIGRATING:
                raise RuntimeError(f"job {job_id} is {state}, not stopped for the move")
            return

    async def _pre_send(self, job_id: str, peer: str, epoch: int, images: Path) -> None:
        """Right before the job pauses for the move: pre-copy to `peer`; where nothing reached it,
        ask whether it answers at all, and if not, fail the checkpoint, so that the job never stops
        for a peer that is gone (it would wait out the sending's patience stopped)."""
        if await self._pre_copy(job_id, peer, epoch, images):
            return
        if not await self.channels.healthy(peer, self.address_of(peer), timeout_s=PEER_CHECK_S):
            raise CheckpointError(f"{peer} does not answer; the job was not stopped")

    async def _pre_copy(self, job_id: str, peer: str, epoch: int, images: Path) -> bool:
        """While the job still runs, send the device state its proxies pre-copied into `images`
        (files that are only appended to from now on) and a base of its process images (see
        bases), so that after the stop only the rest goes. Whether any of it was sent."""
        seq = parse_seq_dir_name(images.parent.name)
        staging = self.outgoing(job_id, epoch).with_name(f"{job_id}@{epoch}.pre")
        if seq is None:
            return False
        began = time.monotonic()
        base = await self._take_base(job_id, peer, epoch)
        try:
            await asyncio.to_thread(jobfiles.stage_pre_copy, staging, images, seq)
            spec = self.daemon.get_job(int(job_id)).spec
            await asyncio.to_thread(jobfiles.stage_precopy_owner, staging, spec.user, spec.uid, spec.gid)
            if base is not None:
                await asyncio.to_thread(bases.stage_base, staging, base)
            source = await asyncio.to_thread(Source, staging, self.chunk_bytes)
            if source.total < MiB:  # nothing was pre-copied: the files hold their headers alone
                return False
            stub = self.channels.stub(peer, self.address_of(peer))
            sending = Sending(
                stub, source, f"{job_id}@{epoch}", job_id, epoch, partial(self._progress, job_id)
            )
            await sending.seed_once()
            self._progress(job_id, Progress("done", source.total, source.total, sending.sent))
        except (TransferError, OSError, KeyError) as error:
            self.transfers.pop(int(job_id), None)
            await asyncio.to_thread(self._drop_base, int(job_id))
            self.note(job_id, f"pre-copy to {peer} failed ({error}); all is sent after the stop")
            return False
        finally:
            await asyncio.to_thread(jobfiles.remove, staging)
        self.pre_sent[int(job_id)] = source
        took = time.monotonic() - began
        base_bytes = await asyncio.to_thread(lambda: base.bytes) if base is not None else 0
        with_base = f" and a {human_bytes(base_bytes)} base of its process images" if base is not None else ""
        froze = f"; dumping the base froze the job {base.frozen_s:.2f}s" if base is not None else ""
        device_bytes = human_bytes(source.total - base_bytes)
        self.note(
            job_id,
            f"sent {device_bytes} of pre-copied device state{with_base} to {peer} in {took:.1f}s{froze}",
        )
        return True

    async def _take_base(self, job_id: str, peer: str, epoch: int) -> bases.ProcessBase | None:
        """An in-place dump of the job's processes to send as a base (None, noted, when there is none)."""
        job_number = int(job_id)
        await asyncio.to_thread(self._drop_base, job_number)
        checkpoints = self.daemon.checkpoints
        pid = self.daemon.get_job(job_number).init_pid
        if not self.daemon.config.move_process_base or not isinstance(checkpoints, JobCheckpoints) or not pid:
            return None
        folder = self.outgoing(job_id, epoch).with_name(f"{job_id}@{epoch}.base")
        try:
            base = await bases.dump_base(checkpoints, job_number, pid, folder)
        except (CheckpointError, OSError) as error:
            await asyncio.to_thread(jobfiles.remove, folder)
            self.note(job_id, f"no base of its process images for {peer} ({error}); they are sent whole")
            return None
        self.bases[job_number] = base
        return base

    def _drop_base(self, job_id: int) -> None:
        """Forget the job's base and delete its files and early recipes, and any a killed daemon
        left (blocking)."""
        self.bases.pop(job_id, None)
        self.early.pop(job_id, None)
        outgoing = self.daemon.config.checkpoints / jobfiles.OUTGOING_DIR
        for folder in (*outgoing.glob(f"{job_id}@*.base"), *outgoing.glob(f"{job_id}@*.early")):
            jobfiles.remove(folder)

    def _begin_early_deltas(self, job_id: str, epoch: int, images: Path) -> None:
        """CRIU has written the final dump into `images`: begin its images' recipes against the
        base (if there is one) while the checkpoint's manifest is hashed."""
        base = self.bases.get(int(job_id))
        if base is None:
            return
        folder = early_folder(self.outgoing(job_id, epoch))
        making = asyncio.ensure_future(asyncio.to_thread(bases.early_deltas, images, base, folder))
        making.add_done_callback(lambda done: done.cancelled() or done.exception())  # seen if never awaited
        self.early[int(job_id)] = making

    async def _early_deltas(self, job_id: str) -> dict[str, bases.EarlyDelta]:
        """The recipes begun once CRIU returned ({} when none were, or their making failed: the
        images' recipes are made now)."""
        making = self.early.pop(int(job_id), None)
        if making is None:
            return {}
        try:
            return await making
        except (OSError, DeltaError) as error:
            log.warning("job %s: the recipes begun after the dump failed (%s); made again", job_id, error)
            return {}

    async def send_checkpoint(self, job_id: str, peer: str, epoch: int) -> None:
        """Stream the job's checkpoint, logs and record to `peer` (resuming after broken links);
        large process images go as their changes against the base sent while the job ran."""
        job = self.daemon.get_job(int(job_id))
        if job.state is not JobState.MIGRATING:
            raise RuntimeError(f"job {job_id} is {job.state}, not stopped for the move")
        staging = self.outgoing(job_id, epoch)
        images = self.images
        seq = await asyncio.to_thread(newest_complete_seq, images, job_id)
        checkpoint = images.checkpoint_dir(job_id, seq) if seq is not None else None
        exported = self.daemon.store.export_job(job.id)
        paths = self.daemon.processes.paths(job.id)
        began = time.monotonic()
        try:
            await asyncio.to_thread(jobfiles.stage_outgoing, staging, exported, checkpoint, seq, paths)
            await self._stage_deltas(
                job_id,
                peer,
                staging,
                partial(jobfiles.stage_outgoing, staging, exported, checkpoint, seq, paths),
            )
            source = await asyncio.to_thread(Source, staging, self.chunk_bytes)
            earlier = self.pre_sent.pop(job.id, None)
            if earlier is not None:
                adopt_digests(source, earlier)
            stub = self.channels.stub(peer, self.address_of(peer))
            sending = Sending(
                stub, source, f"{job_id}@{epoch}", job_id, epoch, partial(self._progress, job_id)
            )
            sending_began = time.monotonic()
            await sending.run(attempts=SEND_ATTEMPTS, pause_s=SEND_PAUSE_S, patience_s=SEND_PATIENCE_S)
            ended = time.monotonic()
            sent_s = ended - sending_began - sending.finish_s
            there = human_bytes(source.total - sending.sent)
            self.note(
                job_id,
                f"sent {human_bytes(sending.sent)} to {peer} after the stop ({sending.sent} bytes; "
                f"{there} of the {human_bytes(source.total)} it needs were there already) in "
                f"{ended - began:.2f}s: staged in {sending_began - began:.2f}s, sent in "
                f"{sent_s:.2f}s, checked by {peer} in {sending.finish_s:.2f}s",
            )
        finally:
            await asyncio.to_thread(jobfiles.remove, staging)

    def _progress(self, job_id: str, report: Progress) -> None:
        """Keep how far a transfer of a leaving job is, for `sing show` and `sing migrate`."""
        self.transfers[int(job_id)] = report
        self.daemon.feed.publish(int(job_id))

    async def _stage_deltas(self, job_id: str, peer: str, staging: Path, restage: Callable[[], None]) -> None:
        """Stage the job's large process images as changes against its base, if it has one (on
        failure, noted, `restage` stages everything again and the images go whole)."""
        base = self.bases.get(int(job_id))
        if base is None:
            return
        began = time.monotonic()
        try:
            early = await self._early_deltas(job_id)
            summary = await asyncio.to_thread(bases.stage_deltas, staging, base, early)
        except (OSError, DeltaError) as error:
            await asyncio.to_thread(restage)
            self.note(job_id, f"process images sent whole to {peer}: no changes against the base ({error})")
            return
        finally:
            await asyncio.to_thread(jobfiles.remove, early_folder(staging))
        if summary.images:
            sent = human_bytes(summary.literal_bytes + summary.recipe_bytes)
            self.note(
                job_id,
                f"process images ({human_bytes(summary.image_bytes)}) sent to {peer} as {sent} of changes "
                f"against the base sent while the job ran (found in {time.monotonic() - began:.1f}s)",
            )

    async def resume_here(self, job_id: str) -> None:
        """If the job is set aside for a move (or held frozen here), let it run here again."""
        self.transfers.pop(int(job_id), None)
        self.pre_sent.pop(int(job_id), None)
        await asyncio.to_thread(self._drop_base, int(job_id))
        self.arrivals.let_run(int(job_id), "the move did not happen")

    async def drop_local_copy(self, job_id: str, peer: str) -> None:
        """The job lives on `peer` now: mark it MOVED, delete its checkpoints and folder here."""
        job_number = int(job_id)
        self.transfers.pop(job_number, None)
        self.pre_sent.pop(job_number, None)
        await asyncio.to_thread(self._drop_base, job_number)
        job = self.daemon.store.get(job_number)
        if job is not None and job.state is JobState.MIGRATING:
            self.daemon.apply(job_number, MovedAway(f"moved to {peer}; it runs there now"))
        job_root = self.daemon.processes.paths(job_number).root
        await asyncio.to_thread(jobfiles.delete_local_copy, self.images, job_root, job_number)

    # Target side: see arrivals

    async def host_problem(self, job_id: str, spec_json: bytes) -> str:
        """Why this node cannot take the job ('' when it can; see Arrivals.host_problem)."""
        return await self.arrivals.host_problem(job_id, spec_json)

    async def restore_frozen(self, job_id: str, epoch: int) -> None:
        """Restore the job arriving for `epoch` with its processes stopped (see Arrivals.restore_frozen)."""
        await self.arrivals.restore_frozen(job_id, epoch)

    async def release_frozen(self, job_id: str, epoch: int) -> None:
        """Let the processes restored for `epoch` run (see Arrivals.release_frozen)."""
        await self.arrivals.release_frozen(job_id, epoch)

    async def discard_incoming(self, job_id: str, epoch: int) -> None:
        """Kill and delete the copy arriving for `epoch` (see Arrivals.discard_incoming)."""
        await self.arrivals.discard_incoming(job_id, epoch)

    def note(self, job_id: str, text: str) -> None:
        """Record an event in the job's log (see Arrivals.note, which keeps an arriving job's)."""
        self.arrivals.note(job_id, text)


def is_owned_here(holding: Holding | None, state: JobState) -> bool:
    """Whether this node owns a job (it may run it): by its holding, else by its state alone."""
    if holding is not None:
        return holding.owns
    return state is not JobState.MOVED and state is not JobState.MIGRATING
