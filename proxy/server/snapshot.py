"""Saving a job's device state with a short pause: pre-copy while it runs, copy what changed, write after.

A save goes through these control requests (the daemon's side is proxy/control.py):

1. `prepare` (with the device-state file's descriptor), while the job runs: pre-copy rounds write
   the bytes of each storage into the file, between the job's operations; then host memory is
   made ready (allocated and touched) for what the pause will copy.
2. The daemon quiesces the job (every rank parks), then `capture`: each storage whose bytes did
   not change since it was pre-copied is taken from the file as it is; the others are copied
   into host memory (for a preemption they are read from the device later instead, since the
   job never runs again there). A thread then writes them, and the index, into the file.
3. The daemon dumps the job's processes, resumes them, and calls `finish` to wait for the file.

`prepare` answers with the records it pre-copied ([offset, bytes]): they stay in the file as they
are, so a move's target can read them into its device before the pause (preloads.py).

Whether a storage changed is known without the kernel's dirty-page tracking: every write an
operator makes to a tensor (its schema marks the argument written, `Tensor(a!)`, as for `out=`)
bumps the tensor's version counter (writes.py, after each operation), which the server's views
share with their base; the server's own writes (uploads into an existing tensor) bump it too,
and a storage's mark (session.py) changes
whenever a tensor that might not share that counter starts using it. A storage's *stamp* joins
its mark, address, size and every holder's version, a view counting as its base (they share one
counter, so views the job makes and frees between the pre-copy and the pause, as a slice of a
tensor it only reads each step, leave the stamp alone); a pre-copied record is used only when the
stamp is the same at the pause as it was before the copy began, so bytes read while an operation
wrote them are never used. Tensors without a version counter (inference tensors) and tensors
that are not plain strided ones are always copied in the pause.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .session import JobNotHere
from .statefile import FORMAT, StateFileWriter, blob_of, is_plain, storage_bytes, tensor_entry

if TYPE_CHECKING:
    from .runner import Runner
    from .service import Server
    from .session import Session

Stamp = tuple[Any, ...] | None
"""What must stay equal for a storage's bytes to be unchanged; None: cannot be told (always copied)."""

SNAPSHOT_REQUESTS = ("prepare", "capture", "finish", "abort", "pause_times")
COPY_CHUNK = 64 << 20
"""Bytes copied by one task in the pause (big storages are split among the copy threads)."""
SETTLED_BYTES = 8 << 20
"""A pre-copy round leaving less than this to copy ends the pre-copy."""


@dataclass
class LiveStorage:
    """A storage the job's tensors use, held (so it stays alive) with its stamp."""

    key: int
    storage: torch.UntypedStorage
    nbytes: int
    stamp: Stamp


def live_storages(sessions: Sequence[Session]) -> dict[int, LiveStorage]:
    """Every storage the sessions' plain tensors use (all back on the device), with its stamp. Call
    with the executor lock held."""
    holders: dict[int, set[Any]] = {}
    found: dict[int, LiveStorage] = {}
    for session in sessions:
        if session.swapped:  # what a waiting session moved to host memory is saved as it was
            session.swap_in_all()
    for session in sessions:
        marks = session.storage_marks
        for tensor in list(session.tensors.values()):
            if not is_plain(tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key not in found:
                found[key] = LiveStorage(key, storage, storage.nbytes(), None)
                holders[key] = set()
            if tensor.is_inference():
                holders[key].add(None)
                continue
            base = tensor._base if tensor._is_view() else None
            counter_owner = tensor if base is None else base
            holders[key].add(
                (
                    session.rank,
                    session.index,
                    session.process,
                    counter_owner._cdata,
                    tensor._version,
                    marks.get(key),
                )
            )
    for key, parts in holders.items():
        if None not in parts:
            live = found[key]
            live.stamp = (live.storage.data_ptr(), live.nbytes, *sorted(parts))
    return found


@dataclass
class SaveReport:
    """Figures of one save on this device, returned by `finish` (bytes, seconds); the daemon sums
    those of a job's devices into its DeviceSaveFigures (singularityd/checkpoint/pause.py)."""

    precopy_rounds: int = 0
    precopy_written_bytes: int = 0
    precopy_seconds: float = 0.0
    precopy_dirtied_bytes: int = 0
    precopy_sync_seconds: float = 0.0
    precopy_records: list[list[int]] = field(default_factory=list)
    """[offset, bytes] of each storage record the pre-copy wrote and found unchanged after (the part
    of the file a move's target may preload: proxy/server/preloads.py)."""
    precopy_ended: str = ""
    """Why the pre-copy stopped: "settled" (little left), "rounds", "budget", or "unsettled" (the job
    wrote its state about as fast as it was saved)."""
    staged_bytes: int = 0
    written_in_pause: bool = False
    """The pause's copy found no host memory, so the state was written while the job stayed parked."""
    reused_bytes: int = 0
    paused_copied_bytes: int = 0
    pause_copy_seconds: float = 0.0
    written_after_bytes: int = 0
    write_after_seconds: float = 0.0
    live_bytes: int = 0
    file_bytes: int = 0
    ranks: int = 0
    parked_at: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """Plain values for the control channel."""
        return dict(vars(self))


class JobSave:
    """One save of one job's device state on this device, into the file open at a descriptor."""

    def __init__(self, server: Server, job_id: str, fd: int, copy_threads: int) -> None:
        self.server = server
        self.job_id = job_id
        self.fd = os.dup(fd)
        self.file = StateFileWriter(self.fd)
        self.copy_threads = max(1, copy_threads)
        self.written: dict[int, tuple[Stamp, int, int]] = {}
        """Storage key -> (stamp when its copy began, offset in the file, bytes) of pre-copied storages."""
        self.staging: torch.Tensor | None = None
        self.report = SaveReport()
        self.writer: threading.Thread | None = None
        self.failure: BaseException | None = None
        self.cancelled = threading.Event()

    def _sessions(self) -> list[Session]:
        sessions = self.server.job_sessions(self.job_id)
        if not sessions and self.server.job_gone(self.job_id):
            raise JobNotHere(f"proxy: job {self.job_id} has nothing on device {self.server.index}")
        return sessions

    def _unsaved(self, live: dict[int, LiveStorage]) -> list[LiveStorage]:
        """The storages whose bytes the file does not hold as they are now."""
        out = []
        for storage in live.values():
            record = self.written.get(storage.key)
            if storage.stamp is None or record is None or record[0] != storage.stamp:
                out.append(storage)
        return out

    # -- while the job runs -----------------------------------------------------------------------
    def precopy(self, rounds: int, budget_s: float) -> None:
        """Write the job's storages into the file, round after round, while its operations go on.

        A round writes every storage not yet in the file as it is now; the ones an operation wrote
        meanwhile are left for the next round (or the pause). Rounds stop when little is left, when
        the job changes its state as fast as it is written, or after `budget_s`.
        """
        lock = self.server.executor.lock
        began = time.monotonic()
        report = self.report
        report.precopy_ended = "rounds" if rounds else ""
        memory = self.server.memory
        for _ in range(rounds):
            with lock:
                todo = [s for s in self._unsaved(live_storages(self._sessions())) if s.stamp is not None]
                memory.begin_reading(s.key for s in todo)  # all on the device now: kept there
            try:
                pending = sum(s.nbytes for s in todo)
                if not todo or (report.precopy_rounds and pending < SETTLED_BYTES):
                    report.precopy_ended = "settled"
                    break
                report.precopy_rounds += 1
                copied = self._precopy_round(todo, began, budget_s)
            finally:
                with lock:
                    memory.end_reading(s.key for s in todo)
            with lock:
                now = live_storages(self._sessions())
            dirtied = 0
            for storage, offset in copied:
                current = now.get(storage.key)
                if current is not None and current.stamp == storage.stamp:
                    self.written[storage.key] = (storage.stamp, offset, storage.nbytes)
                else:
                    dirtied += storage.nbytes
            report.precopy_dirtied_bytes += dirtied
            report.precopy_seconds = time.monotonic() - began
            if time.monotonic() - began > budget_s:
                report.precopy_ended = "budget"
                break
            if 2 * dirtied >= pending:
                report.precopy_ended = "unsettled"
                break
        if report.precopy_written_bytes:
            synced = time.monotonic()
            os.fdatasync(self.fd)  # on disk before the pause: CRIU's writes then meet no dirty backlog
            report.precopy_sync_seconds = time.monotonic() - synced
        report.precopy_seconds = time.monotonic() - began
        report.precopy_records = sorted([offset, nbytes] for _stamp, offset, nbytes in self.written.values())

    def _precopy_round(
        self, todo: list[LiveStorage], began: float, budget_s: float
    ) -> list[tuple[LiveStorage, int]]:
        """Write these storages into the file, biggest first, until `budget_s` from `began`; each
        written one with its offset (those an operation freed meanwhile are left out)."""
        copied: list[tuple[LiveStorage, int]] = []
        for storage in sorted(todo, key=lambda s: -s.nbytes):
            if time.monotonic() - began > budget_s or self.cancelled.is_set():
                break
            try:
                copied.append((storage, self.file.append_bytes(storage_bytes(storage.storage))))
            except OSError as error:
                if not self._changed_under_us(error):
                    raise
                continue
            self.report.precopy_written_bytes += storage.nbytes
        return copied

    @staticmethod
    def _changed_under_us(error: OSError) -> bool:
        """Whether a failed write read memory an operation freed meanwhile (its storage was resized)."""
        return error.errno == 14  # EFAULT

    def stage(self) -> None:
        """Allocate and touch host memory for what the pause will copy, so the copy itself is fast."""
        with self.server.executor.lock:
            unsaved = self._unsaved(live_storages(self._sessions()))
        wanted = sum(s.nbytes for s in unsaved)
        if wanted == 0:
            return
        wanted += min(COPY_CHUNK, wanted // 8)
        pinned = self.server.device.type == "cuda"
        try:
            staging = torch.empty(wanted, dtype=torch.uint8, pin_memory=pinned)
        except RuntimeError:
            return  # no room: the pause allocates what it copies, or the write reads the device
        self._parallel(staging, None)
        self.staging = staging
        self.report.staged_bytes = wanted

    def _parallel(self, target: torch.Tensor, sources: list[tuple[int, torch.Tensor]] | None) -> None:
        """Zero `target` (sources None), or copy each (offset, flat source) into it, in chunks on threads."""
        tasks: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        if sources is None:
            for start in range(0, target.numel(), COPY_CHUNK):
                tasks.append((target[start : start + COPY_CHUNK], None))
        else:
            for offset, source in sources:
                for start in range(0, source.numel(), COPY_CHUNK):
                    part = source[start : start + COPY_CHUNK]
                    tasks.append((target[offset + start : offset + start + part.numel()], part))

        def run(task: tuple[torch.Tensor, torch.Tensor | None]) -> None:
            destination, source = task
            if source is None:
                destination.zero_()
            else:
                destination.copy_(source, non_blocking=destination.is_pinned())

        if self.copy_threads == 1 or len(tasks) == 1:
            for task in tasks:
                run(task)
        else:
            with concurrent.futures.ThreadPoolExecutor(self.copy_threads) as pool:
                list(pool.map(run, tasks))
        if self.server.device.type == "cuda":
            torch.cuda.synchronize(self.server.device)

    # -- in the pause -----------------------------------------------------------------------------
    def capture(self, copy: bool) -> dict[str, Any]:
        """Take the parked job's state: reuse what the file holds, copy the rest (if `copy`), write on.

        Returns when the job may run again (with `copy`) and the file is being finished in the
        background; `finish` waits for it. Without host memory for the copy, the file is written
        before this returns (a longer pause, the same checkpoint).
        """
        if self.writer is not None:
            raise RuntimeError(f"proxy: the state of job {self.job_id} was already captured")
        report = self.report
        with self.server.executor.lock:
            sessions = self._sessions()
            for session in sessions:
                if not session.parked:
                    raise RuntimeError(f"proxy: job {self.job_id} rank {session.rank} is not quiesced")
            began = time.monotonic()
            live = live_storages(sessions)
            ids = {key: number for number, key in enumerate(live)}
            unsaved = {s.key for s in self._unsaved(live)}
            pending: list[tuple[int, torch.Tensor]] = []
            blobs: list[tuple[int, bytes]] = []
            runners = {runner.session.key: runner for runner in self.server.job_runners(self.job_id)}
            table_sessions = [self._describe(s, runners[s.key], ids, blobs) for s in sessions]
            storages: dict[int, list[int]] = {}
            for key, storage in live.items():
                if key in unsaved:
                    pending.append((ids[key], storage_bytes(storage.storage)))
                else:
                    _stamp, offset, nbytes = self.written[key]
                    storages[ids[key]] = [offset, nbytes]
                    report.reused_bytes += nbytes
            written_in_pause = False
            if copy:
                try:
                    pending = self._copy(pending)
                except RuntimeError:  # no host memory for a copy: write from the device, still parked
                    written_in_pause = report.written_in_pause = True
            report.pause_copy_seconds = time.monotonic() - began
            report.parked_at = [s.parked_at for s in sessions if s.parked_at]
            report.ranks = len(sessions)
            report.live_bytes = sum(s.held_bytes for s in sessions)
        index = {
            "format": FORMAT,
            "device": self.server.index,
            "storages": storages,
            "blobs": {},
            "sessions": table_sessions,
        }
        self.writer = threading.Thread(target=self._write_rest, args=(pending, blobs, index), daemon=True)
        self.writer.start()
        if written_in_pause:
            self.writer.join()
        return {
            "parked_at": report.parked_at,
            "copied_bytes": report.paused_copied_bytes,
            "reused_bytes": report.reused_bytes,
            "copy_seconds": report.pause_copy_seconds,
        }

    def _describe(
        self, session: Session, runner: Runner, ids: dict[int, int], blobs: list[tuple[int, bytes]]
    ) -> dict[str, Any]:
        """The index entry of one session (tensors that are not plain, its plans and its queue of
        received-not-run work are serialised now, as blobs)."""
        tensors: dict[str, Any] = {}
        for handle, tensor in session.tensors.items():
            if is_plain(tensor):
                tensors[str(handle)] = tensor_entry(tensor, ids[tensor.untyped_storage()._cdata])
            else:
                blobs.append((len(blobs), blob_of(tensor)))
                tensors[str(handle)] = ["b", len(blobs) - 1]
        plans = None
        if session.plan_wire:
            blobs.append((len(blobs), blob_of(session.plan_wire)))
            plans = len(blobs) - 1
        queue = None
        unfinished = runner.saved_queue()
        if unfinished:
            blobs.append((len(blobs), blob_of(unfinished)))
            queue = len(blobs) - 1
        return {
            "job_id": session.job_id,
            "rank": session.rank,
            "index": session.index,
            "process": session.process,
            "connected": session.connected_when_parked,
            "uid": session.uid,
            "plans": plans,
            "queue": queue,
            "groups": {name: [rank, members] for name, (rank, members) in runner.groups.items()},
            "ops": {str(k): list(v) for k, v in session.operator_names.items()},
            "peak": session.peak_bytes,
            "pending_error": session.pending_error,
            "settings": session.settings,
            "tensors": tensors,
        }

    def _copy(self, pending: list[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
        """Host copies of the pending storages' bytes (into the staged memory while it lasts)."""
        total = sum(flat.numel() for _, flat in pending)
        staging = self.staging
        if staging is None or staging.numel() < total:
            staging = torch.empty(total, dtype=torch.uint8, pin_memory=self.server.device.type == "cuda")
        self.staging = None
        placed: list[tuple[int, torch.Tensor]] = []
        sources: list[tuple[int, torch.Tensor]] = []
        offset = 0
        for storage_id, flat in pending:
            placed.append((storage_id, staging[offset : offset + flat.numel()]))
            sources.append((offset, flat))
            offset += flat.numel()
        self._parallel(staging, sources)
        self.report.paused_copied_bytes = total
        return placed

    # -- after the pause --------------------------------------------------------------------------
    def _write_rest(
        self, pending: list[tuple[int, torch.Tensor]], blobs: list[tuple[int, bytes]], index: dict[str, Any]
    ) -> None:
        """Write what the file lacks, then its index (on the writer thread)."""
        began = time.monotonic()
        try:
            for storage_id, flat in pending:
                if self.cancelled.is_set():
                    raise RuntimeError("proxy: the save was abandoned")
                offset = self.file.append_bytes(flat)
                index["storages"][storage_id] = [offset, flat.numel()]
                self.report.written_after_bytes += flat.numel()
            for blob_id, data in blobs:
                index["blobs"][blob_id] = [self.file.append(data), len(data)]
                self.report.written_after_bytes += len(data)
            self.report.file_bytes = self.file.finish(index)
        except BaseException as error:
            self.failure = error
        finally:
            pending.clear()
            self.report.write_after_seconds = time.monotonic() - began

    def finish(self, timeout: float | None) -> dict[str, Any]:
        """Wait for the file to be written (None: however long it takes); the save's figures."""
        if self.writer is None:
            raise RuntimeError(f"proxy: the state of job {self.job_id} was not captured")
        self.writer.join(timeout)
        if self.writer.is_alive():
            raise TimeoutError(f"proxy: the device state of job {self.job_id} was not written in {timeout}s")
        self.close()
        if self.failure is not None:
            raise self.failure
        return self.report.as_dict()

    def close(self) -> None:
        """Stop any work of this save and let go of its file and memory."""
        self.cancelled.set()
        if self.writer is not None and self.writer is not threading.current_thread():
            self.writer.join()
        self.staging = None
        self.written.clear()
        with contextlib.suppress(OSError):
            os.close(self.fd)


class Snapshots:
    """The saves under way on one server, by job, and the control requests that drive them."""

    def __init__(self, server: Server, copy_threads: int | None = None) -> None:
        self.server = server
        self.copy_threads = copy_threads or min(4, os.cpu_count() or 1)
        self.saves: dict[str, JobSave] = {}
        self.lock = threading.Lock()

    def _save(self, job_id: str) -> JobSave:
        with self.lock:
            save = self.saves.get(job_id)
        if save is None and self.server.job_gone(job_id):
            raise JobNotHere(f"proxy: job {job_id} has nothing on device {self.server.index}")
        if save is None:
            raise RuntimeError(f"proxy: no save of job {job_id} is under way")
        return save

    def begin(self, job_id: str, fd: int) -> JobSave:
        """A new save of the job into the file at `fd` (one left by an earlier, abandoned save goes)."""
        save = JobSave(self.server, job_id, fd, self.copy_threads)
        with self.lock:
            stale = self.saves.pop(job_id, None)
            self.saves[job_id] = save
        if stale is not None:
            stale.close()
        return save

    def end(self, job_id: str, save: JobSave) -> None:
        """Forget a save that is over."""
        with self.lock:
            if self.saves.get(job_id) is save:
                del self.saves[job_id]

    def prepare(self, job_id: str, fd: int, rounds: int, budget_s: float, stage: bool) -> dict[str, Any]:
        """Begin a save: pre-copy `rounds` rounds (for at most `budget_s`), then stage host memory."""
        save = self.begin(job_id, fd)
        try:
            save.precopy(rounds, budget_s)
            if stage:
                save.stage()
        except BaseException:
            self.end(job_id, save)
            save.close()
            raise
        return save.report.as_dict()

    def capture(self, job_id: str, copy: bool) -> dict[str, Any]:
        """Capture the parked job's state (see JobSave.capture)."""
        save = self._save(job_id)
        try:
            return save.capture(copy)
        except BaseException:
            self.end(job_id, save)
            save.close()
            raise

    def finish(self, job_id: str, timeout: float) -> dict[str, Any]:
        """Wait for the save's file; its figures."""
        save = self._save(job_id)
        try:
            return save.finish(timeout)
        except BaseException:
            save.close()  # its writer must not read the device once the job runs on
            raise
        finally:
            self.end(job_id, save)

    def abort(self, job_id: str) -> None:
        """Abandon the job's save, if any."""
        with self.lock:
            save = self.saves.pop(job_id, None)
        if save is not None:
            save.close()

    def save_now(self, job_id: str, fd: int) -> dict[str, Any]:
        """Write the quiesced job's state into the file at `fd` and return when it is written."""
        save = JobSave(self.server, job_id, fd, self.copy_threads)  # beside any save under way
        try:
            save.capture(copy=False)
            return save.finish(None)
        finally:
            save.close()

    def pause_times(self, job_id: str) -> dict[str, list[float]]:
        """When each of the job's processes last parked and was let go (CLOCK_MONOTONIC)."""
        sessions = self.server.job_sessions(job_id)
        return {
            "parked_at": [s.parked_at for s in sessions if s.parked_at],
            "resumed_at": [s.resumed_at for s in sessions if s.resumed_at >= s.parked_at > 0],
        }

    def handle(self, name: str, args: tuple[Any, ...], fds: list[int]) -> Any:
        """Carry out one of SNAPSHOT_REQUESTS."""
        job_id = str(args[0])
        if name == "prepare":
            if len(fds) != 1:
                raise ValueError("a prepare request carries exactly one file descriptor")
            return self.prepare(job_id, fds[0], int(args[1]), float(args[2]), bool(args[3]))
        if name == "capture":
            return self.capture(job_id, bool(args[1]))
        if name == "finish":
            return self.finish(job_id, float(args[1]))
        if name == "abort":
            self.abort(job_id)
            return None
        if name == "pause_times":
            return self.pause_times(job_id)
        raise ValueError(f"unknown control request {name!r}")
