"""The daemon's side of a move (driver.MoveWork): the hand-off's actions carried out on real jobs.

Source: `stop_for_move` asks the job state machine to checkpoint and stop the job (RUNNING ->
MIGRATING; a queued job is just set aside), `send_checkpoint` streams the checkpoint folder, the
logs and the job's record to the peer, `drop_local_copy` marks the job MOVED once the peer holds
it, `resume_here` queues it here again when the move is abandoned.
Target: `host_problem` answers PREPARE, `authorize` lets the transfer in (only for the epoch the
hand-off expects), `restore_frozen` imports the record, reserves devices, places the files and
restores the processes stopped (CRIU --leave-stopped, device state loaded into new proxy
servers), `release_frozen` lets them run on COMMIT (MIGRATING -> RUNNING), `discard_incoming`
kills and deletes what arrived for an epoch that will never run here.

The epoch of the copy restored frozen on this node is kept as a store setting (`arriving:<id>`),
so that a clean-up for an old epoch never touches a newer copy. A restore and a discard of the same
job never overlap (`restoring`): a discard waits for a restore under way and then kills its copy,
so once a discard has returned (and the source been told the epoch was aborted or discarded) no
copy of that epoch exists here, and a restore that finds its epoch already given up does nothing.
Every method is idempotent.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

from singularityd import faults
from singularityd.checkpoint.coordinator import Checkpoints, JobCheckpoints
from singularityd.checkpoint.criu import Criu
from singularityd.checkpoint.errors import CheckpointError
from singularityd.checkpoint.manifest import MANIFEST_NAME, parse_seq_dir_name
from singularityd.checkpoint.precheck import tree_pids
from singularityd.checkpoint.service import Checkpointer, KnownDigests
from singularityd.checkpoint.store import ImageStore
from singularityd.core.actions import TakeCheckpoint
from singularityd.core.decisions import StillLaunching
from singularityd.core.states import InvalidTransition, JobState
from singularityd.core.stimuli import Arrived, MoveAbandoned, MovedAway, MoveStopRequested
from singularityd.daemon import Daemon
from singularityd.errors import RequestError
from singularityd.federation import bases, jobfiles, netlock
from singularityd.federation.facts import MoveFacts
from singularityd.federation.handoff import INCOMING, Holding, Phase, transfer_refusal
from singularityd.federation.holdings import StoredHoldings
from singularityd.federation.hosting import MoveSpec, gather_host_facts, hosting_problem, probe_cwd
from singularityd.federation.pagedelta import DeltaError
from singularityd.federation.peer import PeerChannels, Refused
from singularityd.federation.transfer import MiB, Progress, Source, TransferError, adopt_digests
from singularityd.federation.transfer_grpc import Receivers, Sending
from singularityd.jobs.processes import ProcessId
from singularityd.jobs.work import identity
from singularityd.units import human_bytes

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 * MiB
SEND_ATTEMPTS = 30
SEND_PAUSE_S = 1.0
LAUNCH_WAIT_S = 120.0
INCOMING_DIR = ".incoming"
OUTGOING_DIR = ".outgoing"


def frozen_restorer(checkpoints: Checkpoints) -> Checkpoints:
    """The daemon's checkpoints, restoring with the processes left stopped (CRIU --leave-stopped)."""
    if not isinstance(checkpoints, JobCheckpoints):
        return checkpoints  # restores fail with the reason checkpoints are unavailable
    base = checkpoints.checkpointer
    options = base.criu.options
    criu = Criu(
        base.criu.info, replace(options, extra_restore_args=(*options.extra_restore_args, "--leave-stopped"))
    )
    frozen = Checkpointer(criu, base.store, keep=base.keep, pre_copy=0)
    frozen.userns_problem = base.userns_problem
    return JobCheckpoints(frozen, checkpoints.devices, checkpoints.status)


def newest_complete_seq(images: ImageStore, job: str) -> int | None:
    """The seq of the job's newest checkpoint with a manifest, or None."""
    for seq in reversed(images.seqs(job)):
        if (images.checkpoint_dir(job, seq) / MANIFEST_NAME).exists():
            return seq
    return None


def signal_tree(pid: int, sig: int) -> None:
    """Send a signal to a process and all its descendants."""
    for each in tree_pids(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, sig)


class DaemonMoves:
    """Carries out the hand-off's actions on the daemon's jobs (driver.MoveWork)."""

    def __init__(
        self,
        daemon: Daemon,
        holdings: StoredHoldings,
        channels: PeerChannels,
        address_of: Callable[[str], str],
        *,
        draining: Callable[[], bool],
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.daemon = daemon
        self.holdings = holdings
        self.channels = channels
        self.address_of = address_of
        self.draining = draining
        self.chunk_bytes = chunk_bytes
        self.frozen = frozen_restorer(daemon.checkpoints)
        self.receivers = Receivers(self.authorize)
        self.transfers: dict[int, Progress] = {}
        """The transfer of each job on its way out, as its sender last reported it."""
        self.placing: set[int] = set()
        """Jobs moved only because they could not start here: not to be stopped if they start."""
        self.pre_sent: dict[int, Source] = {}
        """Per job on its way out: what was sent of its device state while it still ran."""
        self.bases: dict[int, bases.ProcessBase] = {}
        """Per job on its way out: the base of its process images sent while it still ran."""
        self._notes: dict[int, list[tuple[float, str]]] = {}
        """Events of jobs arriving here before their record exists (written once it does)."""
        self.restoring: dict[int, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        """Per arriving job: held by its restore, so that a discard waits for it to end."""

    # Places

    @property
    def images(self) -> ImageStore:
        """The daemon's image store (where checkpoints live)."""
        return ImageStore(self.daemon.config.checkpoints)

    def incoming(self, job_id: str, epoch: int) -> Path:
        """Where the files of one epoch of an arriving job are received."""
        return self.daemon.config.checkpoints / INCOMING_DIR / f"{job_id}@{epoch}"

    def outgoing(self, job_id: str, epoch: int) -> Path:
        """Where the files of a leaving job are staged (hard links) for one epoch."""
        return self.daemon.config.checkpoints / OUTGOING_DIR / f"{job_id}@{epoch}"

    def _arriving_epoch(self, job_id: int) -> int | None:
        value = self.daemon.store.setting(f"arriving:{job_id}")
        return int(value) if value else None

    def _set_arriving_epoch(self, job_id: int, epoch: int | None) -> None:
        self.daemon.store.set_setting(f"arriving:{job_id}", None if epoch is None else str(epoch))

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
        daemon.before_move_pause[job_number] = partial(self._pre_send, job_id, peer, epoch)
        try:
            await self._stop(job_number, peer)
        finally:
            daemon.before_move_pause.pop(job_number, None)

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
                with contextlib.suppress(RequestError, KeyError, asyncio.CancelledError):
                    await daemon.checkpoint_outcome(job_number)  # a periodic one: wait for it
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
        """While the job still runs, send the device state its proxies pre-copied into `images`
        (files that are only appended to from now on) and a base of its process images (see
        bases), so that after the stop only the rest goes."""
        seq = parse_seq_dir_name(images.parent.name)
        staging = self.outgoing(job_id, epoch).with_name(f"{job_id}@{epoch}.pre")
        if seq is None:
            return
        began = time.monotonic()
        base = await self._take_base(job_id, peer, epoch)
        try:
            await asyncio.to_thread(jobfiles.stage_pre_copy, staging, images, seq)
            if base is not None:
                await asyncio.to_thread(bases.stage_base, staging, base)
            source = await asyncio.to_thread(Source, staging, self.chunk_bytes)
            if source.total < MiB:  # nothing was pre-copied: the files hold their headers alone
                return
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
            return
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
        """Forget the job's base and delete its files, and any a killed daemon left (blocking)."""
        self.bases.pop(job_id, None)
        for folder in (self.daemon.config.checkpoints / OUTGOING_DIR).glob(f"{job_id}@*.base"):
            jobfiles.remove(folder)

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
            await sending.run(attempts=SEND_ATTEMPTS, pause_s=SEND_PAUSE_S)
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
            summary = await asyncio.to_thread(bases.stage_deltas, staging, base)
        except (OSError, DeltaError) as error:
            await asyncio.to_thread(restage)
            self.note(job_id, f"process images sent whole to {peer}: no changes against the base ({error})")
            return
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
        self._let_run(int(job_id), "the move did not happen")

    async def drop_local_copy(self, job_id: str, peer: str) -> None:
        """The job lives on `peer` now: mark it MOVED, delete its checkpoints and folder here."""
        job_number = int(job_id)
        self.transfers.pop(job_number, None)
        self.pre_sent.pop(job_number, None)
        await asyncio.to_thread(self._drop_base, job_number)
        job = self.daemon.store.get(job_number)
        if job is not None and job.state is JobState.MIGRATING:
            self.daemon.apply(job_number, MovedAway(f"moved to {peer}; it runs there now"))
        await asyncio.to_thread(self._delete_local_files, job_number)

    def _delete_local_files(self, job_id: int) -> None:
        """Remove a job's checkpoints, the network lock of its last dump and its folder from this
        node (it does not run here)."""
        checkpoints = self.images.job_dir(str(job_id))
        for table in netlock.lock_table_names(checkpoints) if checkpoints.is_dir() else []:
            try:
                if netlock.delete_inet_table(table):
                    log.info("job %s: network lock %s of its last dump deleted", job_id, table)
            except OSError as error:
                log.warning("job %s: cannot delete network lock %s: %s", job_id, table, error)
        jobfiles.remove(checkpoints)
        jobfiles.remove(self.daemon.processes.paths(job_id).root)
        for staged in (self.daemon.config.checkpoints / OUTGOING_DIR).glob(f"{job_id}@*"):
            jobfiles.remove(staged)

    # Target side

    async def host_problem(self, job_id: str, spec_json: bytes) -> str:
        """Why this node cannot take the job ('' when it can)."""
        try:
            spec = MoveSpec.from_json(spec_json)
        except ValueError as error:
            return str(error)
        if spec.job_id != job_id:
            return f"the spec names job {spec.job_id}, the request job {job_id}"
        daemon = self.daemon
        facts = await asyncio.to_thread(
            gather_host_facts,
            spec,
            daemon.config.state_dir,
            devices=len(daemon.inventory.devices),
            checkpoints_available=daemon.checkpoints.available,
        )
        facts = replace(
            facts,
            draining=self.draining(),
            free_devices=len(self._free_devices()),
            jobs_dir=str(daemon.config.jobs_dir),
            id_taken=self._id_taken(int(job_id)),
        )
        return hosting_problem(spec, facts)

    def _id_taken(self, job_id: int) -> str:
        """Why a job arriving with this id cannot have it here ('' when it can)."""
        job = self.daemon.store.get(job_id)
        holding = self.holdings.load(str(job_id))
        if job is None or job.state is JobState.MOVED:
            return ""
        if job.state is JobState.MIGRATING and (holding is None or not holding.owns):
            return ""  # a copy of an earlier attempt, superseded by this one
        return f"a job with id {job_id} already lives on this node ({job.state})"

    def _free_devices(self, arriving: int | None = None) -> list[int]:
        """Devices no job holds or has reserved (but those reserved for an earlier copy of `arriving`)."""
        busy = {d: job for d, job in self.daemon.store.busy_devices().items() if job != arriving}
        return [d.index for d in self.daemon.inventory.devices if d.index not in busy]

    def authorize(self, node: str, job_id: str, epoch: int) -> Path:
        """The folder to receive a job's files into, only for the epoch the hand-off expects."""
        if not job_id.isdigit():
            raise Refused(f"bad job id {job_id!r}")
        refusal = transfer_refusal(self.holdings.load(job_id), node, epoch)
        if refusal:
            raise Refused(refusal)
        return self.incoming(job_id, epoch)

    async def restore_frozen(self, job_id: str, epoch: int) -> None:
        """Import the job, reserve its devices, place its files, restore its processes stopped
        (nothing if the epoch was given up before the restore began)."""
        async with self.restoring[int(job_id)]:
            holding = self.holdings.load(job_id)
            if holding is None or holding.phase is not Phase.IN_RESTORING or holding.epoch != epoch:
                raise RuntimeError(f"epoch {epoch} of job {job_id} was given up before its restore began")
            await self._restore_frozen(job_id, epoch, holding)
            await faults.held_at(faults.RESTORED_FROZEN)

    async def _restore_frozen(self, job_id: str, epoch: int, holding: Holding) -> None:
        """See restore_frozen (the job's restore lock held)."""
        job_number = int(job_id)
        daemon = self.daemon
        source = holding.peer
        incoming = self.incoming(job_id, epoch)
        arrival = await asyncio.to_thread(jobfiles.read_arrival, incoming)
        if arrival.job_id != job_number:
            raise RuntimeError(f"the received record is for job {arrival.job_id}, not {job_id}")
        began = time.monotonic()
        received = self.receivers.take_digests(job_id, epoch)
        try:  # before the restore checks every file against the checkpoint's manifest
            rebuilt = await asyncio.to_thread(bases.rebuild_deltas, incoming)
        except (OSError, DeltaError) as error:
            raise RuntimeError(f"cannot rebuild the process images from their base: {error}") from None
        rebuild_s = time.monotonic() - began
        if rebuilt:
            rebuilt_note = (
                f"rebuilt {len(rebuilt)} process images from their base and changes in {rebuild_s:.1f}s"
            )
            self.note(job_id, rebuilt_note)
        await self._kill_frozen(job_number)
        needed = arrival.gpus if arrival.seq is not None else 0
        free = self._free_devices(arriving=job_number)
        if len(free) < needed:
            raise RuntimeError(f"no room: the job needs {needed} devices; {len(free)} are free")
        devices = tuple(free[:needed])
        reason = f"arriving from {source} (epoch {epoch})"
        notes = self._notes.pop(job_number, [])
        # The marker goes first: a restart that finds it gives the copy up whether or not the record
        # below was imported, while a record imported without it would stay MIGRATING for good.
        self._set_arriving_epoch(job_number, epoch)
        daemon.store.import_job(arrival.exported, reason, daemon.clock(), devices, notes)
        faults.reached(faults.ARRIVAL_IMPORTED)
        daemon.feed.publish(job_number)
        paths = daemon.processes.paths(job_number)
        await asyncio.to_thread(jobfiles.place_arrival, incoming, arrival, self.images, paths)
        if arrival.seq is None:
            return  # a queued job: nothing runs until it is released
        job = daemon.get_job(job_number)
        await daemon.devices.admit(job_number, identity(job), devices)
        daemon.processes.forget_outcome(job_number)
        restore_began = time.monotonic()
        known = arrived_digests(arrival.seq, received | rebuilt)
        restored = await self.frozen.restore(job_number, devices, known_digests=known)
        process = daemon.processes.adopt_restored(job_number, restored.pid)
        daemon.store.set_process(job_number, process.pid, process.start_ticks)
        if restored.problem:
            raise RuntimeError(restored.problem)
        await asyncio.to_thread(jobfiles.remove, incoming)
        ended = time.monotonic()
        parts = f": {restored.parts.summary()}" if restored.parts is not None else ""
        self.note(
            job_id,
            f"restore frozen took {ended - began:.2f}s (images rebuilt in {rebuild_s:.2f}s, files placed in "
            f"{restore_began - began - rebuild_s:.2f}s, restored in {ended - restore_began:.2f}s{parts})",
        )

    async def release_frozen(self, job_id: str, epoch: int) -> None:
        """The job is ours: let the processes restored for `epoch` run (nothing if they already do)."""
        holding = self.holdings.load(job_id)
        source = holding.peer if holding is not None else "its source"
        self._let_run(int(job_id), f"committed by {source}")

    def _let_run(self, job_id: int, why: str) -> None:
        """A MIGRATING job stays here: its frozen processes continue, or it is queued to resume."""
        daemon = self.daemon
        job = daemon.store.get(job_id)
        if job is None or job.state is not JobState.MIGRATING:
            return
        process = ProcessId(job.init_pid, job.init_start_ticks or 0) if job.init_pid else None
        self._set_arriving_epoch(job_id, None)
        if process is not None and daemon.processes.alive(process):
            signal_tree(process.pid, signal.SIGCONT)
            reason = f"{why}: running here"
            daemon.apply(job_id, Arrived(process.pid, process.start_ticks, job.devices, reason))
            return
        daemon.apply(job_id, MoveAbandoned(f"{why}: queued to resume here"))

    async def discard_incoming(self, job_id: str, epoch: int) -> None:
        """Kill what was restored for `epoch` and delete what was received for it (after a restore
        under way has ended: once this returns, no copy of the epoch exists here)."""
        job_number = int(job_id)
        self.receivers.cancel(job_id, epoch)
        async with self.restoring[job_number]:
            await self._discard_incoming(job_id, epoch)

    async def _discard_incoming(self, job_id: str, epoch: int) -> None:
        """See discard_incoming (the job's restore lock held)."""
        job_number = int(job_id)
        self._notes.pop(job_number, None)
        await asyncio.to_thread(jobfiles.remove, self.incoming(job_id, epoch))
        holding = self.holdings.load(job_id)
        if self._arriving_epoch(job_number) != epoch or (holding is not None and holding.owns):
            return
        await self._kill_frozen(job_number)
        job = self.daemon.store.get(job_number)
        if job is not None and job.state is JobState.MIGRATING:
            self.daemon.apply(job_number, MovedAway(f"the copy arriving for epoch {epoch} was given up"))
        self._set_arriving_epoch(job_number, None)
        if job is not None:
            await asyncio.to_thread(self._delete_local_files, job_number)

    async def _kill_frozen(self, job_id: int) -> None:
        """Kill the processes of a copy restored frozen here earlier (never a job running here)."""
        job = self.daemon.store.get(job_id)
        if job is None or job.state is not JobState.MIGRATING or job.init_pid is None:
            return
        process = ProcessId(job.init_pid, job.init_start_ticks or 0)
        if self.daemon.processes.alive(process):
            signal_tree(process.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10.0
            while self.daemon.processes.alive(process) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        self.daemon.devices.forget(job_id)

    def note(self, job_id: str, text: str) -> None:
        """Record an event in the job's log (kept until the record arrives, for an arriving job)."""
        job_number = int(job_id)
        daemon = self.daemon
        job = daemon.store.get(job_number)
        holding = self.holdings.load(job_id)
        arriving = holding is not None and holding.phase in INCOMING
        if job is None or (arriving and job.state is not JobState.MIGRATING):
            self._notes.setdefault(job_number, []).append((daemon.clock(), text))
            return
        daemon.store.add_note(job_number, job.state, text, daemon.clock())
        daemon.feed.publish(job_number)
        log.info("job %d: %s", job_number, text)


def arrived_digests(seq: int, digests: dict[str, str]) -> KnownDigests:
    """The sha256 of checkpoint `seq`'s files hashed here as they were received or rebuilt (given by
    path in the received folder), for its frozen restore to check against the manifest without
    reading them again."""
    prefix = f"{jobfiles.CHECKPOINT_DIR}/{seq}/"
    return {seq: {path.removeprefix(prefix): d for path, d in digests.items() if path.startswith(prefix)}}


def is_owned_here(holding: Holding | None, state: JobState) -> bool:
    """Whether this node owns a job (it may run it): by its holding, else by its state alone."""
    if holding is not None:
        return holding.owns
    return state is not JobState.MOVED and state is not JobState.MIGRATING
