"""The target side of a move: the jobs arriving on this node, admitted, restored frozen, released
or discarded (the target half of driver.MoveWork; `moves.DaemonMoves`, the source half, hands
these methods to the driver with its own).

`host_problem` answers PREPARE, `authorize` lets the transfer in (only for the epoch the hand-off
expects), `restore_frozen` imports the record, reserves devices, places the files and restores the
processes stopped (CRIU --leave-stopped, device state loaded into new proxy servers),
`release_frozen` lets them run on COMMIT (MIGRATING -> RUNNING), `discard_incoming` kills and
deletes what arrived for an epoch that will never run here. The device state pre-copied while the
job still runs on its source is read onto this node's devices as soon as it has arrived
(preloading.py), and the restore takes it there.

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
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import replace
from pathlib import Path

from singularityd import faults
from singularityd.checkpoint.coordinator import JobCheckpoints
from singularityd.checkpoint.criu import LEAVE_STOPPED, Criu
from singularityd.checkpoint.errors import CheckpointError
from singularityd.checkpoint.hashing import hash_open_files, open_for_hashing
from singularityd.checkpoint.interface import Checkpoints
from singularityd.checkpoint.manifest import IMAGES_DIR, ManifestError, digest_problems
from singularityd.checkpoint.precheck import signal_tree
from singularityd.checkpoint.restoring import KnownDigests, continue_as_dumped
from singularityd.checkpoint.service import Checkpointer
from singularityd.checkpoint.store import ImageStore
from singularityd.core.states import JobState, was_suspended_when_set_aside
from singularityd.core.stimuli import Arrived, MoveAbandoned, MovedAway
from singularityd.daemon import Daemon
from singularityd.devices.splicing import logical_devices
from singularityd.federation import bases, jobfiles
from singularityd.federation.handoff import INCOMING, Holding, Phase, transfer_refusal
from singularityd.federation.holdings import StoredHoldings
from singularityd.federation.hosting import MoveSpec, gather_host_facts, hosting_problem
from singularityd.federation.pagedelta import DeltaError
from singularityd.federation.peer import Refused
from singularityd.federation.preloading import Preloads
from singularityd.federation.transfer_grpc import Receivers
from singularityd.jobs.processes import ProcessId
from singularityd.jobs.work import identity
from singularityd.units import counted

log = logging.getLogger(__name__)


def frozen_restorer(checkpoints: Checkpoints) -> Checkpoints:
    """The daemon's checkpoints, restoring with the processes left stopped (CRIU --leave-stopped)."""
    if not isinstance(checkpoints, JobCheckpoints):
        return checkpoints  # restores fail with the reason checkpoints are unavailable
    base = checkpoints.checkpointer
    options = base.criu.options
    criu = Criu(
        base.criu.info, replace(options, extra_restore_args=(*options.extra_restore_args, LEAVE_STOPPED))
    )
    frozen = Checkpointer(criu, base.store, keep=base.keep, pre_copy=0)
    frozen.userns_problem = base.userns_problem
    return JobCheckpoints(frozen, checkpoints.devices, checkpoints.status)


def arrived_digests(seq: int, digests: Mapping[str, str], hashing: Collection[str] = ()) -> KnownDigests:
    """For checkpoint `seq`'s frozen restore, by path in the received folder: the sha256 of its
    files hashed here as they were received (checked against the manifest without reading them
    again), and the files still being hashed (`hashing`, checked once CRIU has restored)."""
    prefix = f"{jobfiles.CHECKPOINT_DIR}/{seq}/"
    return KnownDigests(
        seq,
        {path.removeprefix(prefix): d for path, d in digests.items() if path.startswith(prefix)},
        frozenset(path.removeprefix(prefix) for path in hashing if path.startswith(prefix)),
    )


async def rebuilt_problems(
    checking: asyncio.Future[dict[str, str]], known: KnownDigests, images: ImageStore, job_id: str
) -> list[str]:
    """Once `checking` (the sha256 of the rebuilt images, by path in the received folder) is done:
    those of `known.checked_by_caller` that differ from the restored checkpoint's manifest."""
    try:
        digests = await checking
        manifest = await asyncio.to_thread(images.read_manifest, job_id, known.seq)
    except (OSError, ManifestError) as error:
        return [f"the rebuilt process images could not be checked: {error}"]
    prefix = f"{jobfiles.CHECKPOINT_DIR}/{known.seq}/"
    by_name = {path.removeprefix(prefix): digest for path, digest in digests.items()}
    return digest_problems(manifest, by_name, known.checked_by_caller)


class Arrivals:
    """Takes in, restores frozen, releases or discards the jobs moving to this node."""

    def __init__(self, daemon: Daemon, holdings: StoredHoldings, *, draining: Callable[[], bool]) -> None:
        self.daemon = daemon
        self.holdings = holdings
        self.draining = draining
        self.images = ImageStore(daemon.config.checkpoints)
        """The daemon's image store (where checkpoints live)."""
        self.frozen = frozen_restorer(daemon.checkpoints)
        self._notes: dict[int, list[tuple[float, str]]] = {}
        """Events of jobs arriving here before their record exists (written once it does)."""
        self.restoring: dict[int, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        """Per arriving job: held by its restore (or preload), so that a discard waits for it to end."""
        self.preloads = Preloads(daemon, holdings, self.restoring.__getitem__, self._free_devices, self.note)
        self.drafting: dict[tuple[int, int], asyncio.Future[int]] = {}
        """Per (job, epoch): the copy of a received base into drafts of its process images."""
        self.receivers = Receivers(self.authorize, self._received)

    def _received(self, job_id: str, epoch: int, directory: Path) -> Awaitable[object] | None:
        """A transfer for (job, epoch) has all its chunks: if it was the pre-send (no recipes yet),
        preload its device state and draft its process images over the base that came with it,
        while the job still runs on its source (bases.draft_images); both, for the sender to wait
        for before it stops the job."""
        preloading = self.preloads.received(job_id, epoch, directory)
        key = (int(job_id), epoch)
        pre_send = not (directory / bases.DELTA_DIR).exists()
        if pre_send and key not in self.drafting and (directory / bases.BASE_DIR).is_dir():
            self.drafting[key] = asyncio.ensure_future(asyncio.to_thread(bases.draft_images, directory))
        started = [each for each in (preloading, self.drafting.get(key) if pre_send else None) if each]
        return asyncio.gather(*started, return_exceptions=True) if started else None

    async def _drafted(self, job_id: int, epoch: int) -> None:
        """Wait for the drafting of (job, epoch)'s process images, if any, to end (a failure only
        means the rebuild writes new files)."""
        drafting = self.drafting.pop((job_id, epoch), None)
        if drafting is not None:
            try:
                await drafting
            except OSError as error:
                log.warning("job %d: drafting its process images failed: %s", job_id, error)

    def incoming(self, job_id: str, epoch: int) -> Path:
        """Where the files of one epoch of an arriving job are received."""
        return self.images.root / jobfiles.INCOMING_DIR / f"{job_id}@{epoch}"

    def _arriving_epoch(self, job_id: int) -> int | None:
        value = self.daemon.store.setting(f"arriving:{job_id}")
        return int(value) if value else None

    def _set_arriving_epoch(self, job_id: int, epoch: int | None) -> None:
        self.daemon.store.set_setting(f"arriving:{job_id}", None if epoch is None else str(epoch))

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
        """Devices no job holds or has reserved (but those reserved for an earlier copy of `arriving`),
        nor holds state preloaded for another arriving job."""
        busy = {d: job for d, job in self.daemon.store.busy_devices().items() if job != arriving}
        preloading = self.preloads.devices_held(but=arriving)
        return [d.index for d in self.daemon.inventory.devices if d.index not in {*busy, *preloading}]

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
        incoming = self.incoming(job_id, epoch)
        arrival = await asyncio.to_thread(jobfiles.read_arrival, incoming)
        if arrival.job_id != int(job_id):
            raise RuntimeError(f"the received record is for job {arrival.job_id}, not {job_id}")
        began = time.monotonic()
        await self._drafted(arrival.job_id, epoch)
        drafts = await asyncio.to_thread(bases.drafts_ready, incoming)
        try:  # hashed beside CRIU's restore and checked before the processes run (the rest before it)
            rebuilt = await asyncio.to_thread(bases.rebuild_deltas, incoming, hash_as_written=False)
            opened = await asyncio.to_thread(open_for_hashing, incoming, list(rebuilt))
        except (OSError, DeltaError) as error:
            raise RuntimeError(f"cannot rebuild the process images from their base: {error}") from None
        checking = asyncio.ensure_future(asyncio.to_thread(hash_open_files, opened))
        rebuild_s = time.monotonic() - began
        if rebuilt:
            rebuilt_note = (
                f"rebuilt {len(rebuilt)} process images from their base and changes in {rebuild_s:.1f}s"
                + (f", over {drafts} drafts copied from the base while the job ran" if drafts else "")
            )
            self.note(job_id, rebuilt_note)
        try:
            known = arrived_digests(arrival.seq or 0, self.receivers.take_digests(job_id, epoch), rebuilt)
            await self._restore_placed(job_id, epoch, holding, arrival, known, checking, began, rebuild_s)
        finally:  # a hashing never awaited is let go (its thread still closes the files)
            if not checking.cancel() and not checking.cancelled():
                checking.exception()  # seen, so that an error of the hashing is not reported as lost

    async def _restore_placed(
        self,
        job_id: str,
        epoch: int,
        holding: Holding,
        arrival: jobfiles.Arrival,
        known: KnownDigests,
        checking: asyncio.Future[dict[str, str]],
        began: float,
        rebuild_s: float,
    ) -> None:
        """_restore_frozen once the process images are rebuilt (begun at `began`, taking
        `rebuild_s`), the files of `known.checked_by_caller` still being hashed by `checking`."""
        job_number = int(job_id)
        daemon = self.daemon
        await self._kill_frozen(job_number)
        brought = [(event["from_state"], event["to_state"]) for event in arrival.exported.get("events", [])]
        held = was_suspended_when_set_aside(brought)
        needed = arrival.gpus if arrival.seq is not None and not held else 0
        free = self._free_devices(arriving=job_number)
        if len(free) < needed:
            raise RuntimeError(f"no room: the job needs {counted(needed, 'device')}; {len(free)} free")
        preloaded = self.preloads.take(job_number, epoch, needed)
        devices = preloaded.devices if preloaded is not None else tuple(free[:needed])
        reason = f"arriving from {holding.peer} (epoch {epoch})"
        notes = self._notes.pop(job_number, [])
        # The marker goes first: a restart that finds it gives the copy up whether or not the record
        # below was imported, while a record imported without it would stay MIGRATING for good.
        self._set_arriving_epoch(job_number, epoch)
        daemon.store.import_job(arrival.exported, reason, daemon.clock(), devices, notes)
        faults.reached(faults.ARRIVAL_IMPORTED)
        daemon.feed.publish(job_number)
        paths = daemon.processes.paths(job_number)
        incoming = self.incoming(job_id, epoch)
        await asyncio.to_thread(jobfiles.place_arrival, incoming, arrival, self.images, paths)
        if arrival.seq is None or held:
            return  # a queued or suspended job: nothing runs until it is released
        job = daemon.get_job(job_number)
        logical = logical_devices(job.spec.ranks, job.spec.gpus)  # more than it holds when spliced
        if preloaded is None or identity(job) != preloaded.identity or logical != len(devices):
            await daemon.devices.admit(job_number, identity(job), devices, logical)  # a preload's servers go
        daemon.processes.forget_outcome(job_number)
        restore_began = time.monotonic()
        try:
            restored = await self.frozen.restore(
                job_number, devices, logical, known_digests=known, user=identity(job)
            )
        except CheckpointError:
            # Wrong memory can make CRIU itself fail (its restorer runs inside the restored
            # processes): then the wrong image, not CRIU's symptom, is the reason given.
            if known.checked_by_caller:
                await self._refuse_wrong_rebuild(checking, known, job_id)
            raise
        process = daemon.processes.adopt_restored(job_number, restored.pid)
        daemon.store.set_process(job_number, process.pid, process.start_ticks)
        if restored.problem:
            raise RuntimeError(restored.problem)
        restored_at = time.monotonic()
        if restored.seq == known.seq and known.checked_by_caller:
            await self._refuse_wrong_rebuild(checking, known, job_id)
        checked_at = time.monotonic()
        await asyncio.to_thread(jobfiles.remove, incoming)
        parts = f": {restored.parts.summary()}" if restored.parts is not None else ""
        self.note(
            job_id,
            f"restore frozen took {time.monotonic() - began:.2f}s (images rebuilt in {rebuild_s:.2f}s, "
            f"files placed in {restore_began - began - rebuild_s:.2f}s, "
            f"restored in {restored_at - restore_began:.2f}s{parts}; "
            f"the rebuilt images' checksums awaited {checked_at - restored_at:.2f}s more)",
        )

    async def _refuse_wrong_rebuild(
        self, checking: asyncio.Future[dict[str, str]], known: KnownDigests, job_id: str
    ) -> None:
        """Raise RuntimeError if the rebuilt process images being hashed by `checking` differ from
        the manifest of the checkpoint that arrived."""
        problems = await rebuilt_problems(checking, known, self.images, job_id)
        if problems:
            raise RuntimeError(f"the process images rebuilt from their base: {'; '.join(problems)}")

    async def release_frozen(self, job_id: str, epoch: int) -> None:
        """The job is ours: let the processes restored for `epoch` run (nothing if they already do)."""
        holding = self.holdings.load(job_id)
        source = holding.peer if holding is not None else "its source"
        self.let_run(int(job_id), f"committed by {source}")

    def let_run(self, job_id: int, why: str) -> None:
        """A MIGRATING job stays here: its frozen processes continue, or it is queued to resume."""
        daemon = self.daemon
        job = daemon.store.get(job_id)
        if job is None or job.state is not JobState.MIGRATING:
            return
        process = ProcessId(job.init_pid, job.init_start_ticks or 0) if job.init_pid else None
        self._set_arriving_epoch(job_id, None)
        if process is not None and daemon.processes.alive(process):
            seqs = self.images.seqs(str(job_id))  # the newest is the one restored
            if seqs:
                continue_as_dumped(
                    process.pid, self.images.checkpoint_dir(str(job_id), seqs[-1]) / IMAGES_DIR
                )
            else:
                signal_tree(process.pid, signal.SIGCONT)
            reason = f"{why}: running here"
            daemon.apply(job_id, Arrived(process.pid, process.start_ticks, job.devices, reason))
            return
        history = [
            (e.from_state.value if e.from_state else None, e.to_state.value)
            for e in daemon.store.events(job_id)
        ]
        if was_suspended_when_set_aside(history):
            daemon.apply(job_id, MoveAbandoned(f"{why}: suspended here until `sing resume`", held=True))
        else:
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
        await self.preloads.drop(job_number, epoch)
        await self._drafted(job_number, epoch)
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
            job_root = self.daemon.processes.paths(job_number).root
            await asyncio.to_thread(jobfiles.delete_local_copy, self.images, job_root, job_number)

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
        self.preloads.held.pop(job_id, None)  # the same servers
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
