"""The calls the daemon makes over a job's proxy servers: park and save, settle, resume, release,
preload the pre-copied part of a checkpoint's device state, load it back, and ask a server how it
is doing.

The servers themselves (spawned as the job's user, watched, adopted after a restart) are
`ProxyServers` (proxy_servers.py); `JobProxies` adds these calls to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from singularity.proxy.control import (
    ControlError,
    ProxyControl,
    client_sockets,
    cut_reached,
    open_restored_connection,
)
from singularityd.checkpoint.precheck import read_proc_facts
from singularityd.devices.proxy_servers import PROXY_DIR, ProxyError, ProxyServers
from singularityd.devices.regroup import RegroupError, regroup
from singularityd.devices.splicing import SavedLayout, device_slots
from singularityd.units import counted

log = logging.getLogger(__name__)

STATE_FILE_SUFFIX = ".state"
PRECOPIED_SUFFIX = ".precopied"
ANY_DEVICE = -1
"""The device index a saved session has when its server did not know it (the server's
UNKNOWN_DEVICE): a restored connection to any of the job's devices resumes it."""


class Reconnection(NamedTuple):
    """What `reconnect` did: CRIU's --inherit-fd map, the sockets to close once restored, and the
    device-state bytes the servers had in their files and took preloaded instead of reading."""

    inherit: dict[str, int]
    sockets: list[socket.socket]
    file_bytes: int = 0
    preloaded_bytes: int = 0


@dataclass(frozen=True)
class ProxyConnection:
    """One job process's connection to one of its devices, as found before a dump."""

    pid: int
    rank: int
    index: int
    inode: int
    process: int = 0
    """The process's own pid, in the job's PID namespace: the server's sessions tell a rank's
    processes apart by it."""

    def as_dict(self) -> dict[str, int]:
        """JSON form, kept in the checkpoint's manifest."""
        return {
            "pid": self.pid,
            "rank": self.rank,
            "index": self.index,
            "inode": self.inode,
            "process": self.process,
        }


def _rank_of(pid: int) -> int:
    """The RANK a job process was started with (0 when it has none)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return 0
    for entry in environ:
        if entry.startswith(b"RANK="):
            with contextlib.suppress(ValueError):
                return int(entry[5:])
    return 0


def job_connections(pids: Sequence[int]) -> list[ProxyConnection]:
    """Every proxy connection held by the given processes of a job (`pids` root first, as
    tree_pids lists them): one that forked children inherited (a DataLoader's workers hold their
    parent's) is listed once, for the process that opened it, whose session it is."""
    found = []
    seen: set[int] = set()
    for pid in pids:
        try:
            sockets = client_sockets(pid)
        except OSError:
            continue
        opened = [(index, inode) for index, (_, inode) in sorted(sockets.items()) if inode not in seen]
        if not opened:
            continue
        facts = read_proc_facts(pid, with_tcp=False)
        rank, process = _rank_of(pid), facts.nspid[-1] if facts is not None else pid  # its pid, as it sees it
        found += [ProxyConnection(pid, rank, index, inode, process) for index, inode in opened]
        seen.update(inode for _, inode in opened)
    return found


def _was_connected(connected: set[tuple[int, int, int]], rank: int, index: int, process: int) -> bool:
    """Whether the process's connection was open when the checkpoint parked the job (it was not
    when its session is missing: the server lets the session of an ended connection go)."""
    return (rank, index, process) in connected or (rank, ANY_DEVICE, process) in connected


def device_state_file(images: Path, index: int) -> Path:
    """Where a checkpoint keeps the device state of the job's device `index` (cuda:index)."""
    return images / PROXY_DIR / f"cuda{index}{STATE_FILE_SUFFIX}"


def precopied_records_file(images: Path, index: int) -> Path:
    """Where a checkpoint keeps the [offset, bytes] records its pre-copy wrote into the device-state
    file of device `index` (JSON; what a move's target may preload)."""
    return images / PROXY_DIR / f"cuda{index}{PRECOPIED_SUFFIX}"


def write_precopied_records(images: Path, index: int, records: Sequence[Sequence[int]]) -> None:
    """Keep the records a device's pre-copy wrote beside its device-state file."""
    precopied_records_file(images, index).write_text(json.dumps([[int(o), int(n)] for o, n in records]))


def read_precopied_records(images: Path, index: int) -> list[tuple[int, int]]:
    """The records a device's pre-copy wrote (empty when none were kept or the file is unusable)."""
    try:
        found = json.loads(precopied_records_file(images, index).read_text())
        return [(int(offset), int(nbytes)) for offset, nbytes in found]
    except (OSError, ValueError, TypeError):
        return []


class JobProxies(ProxyServers):
    """The proxy servers of every job, with the calls the daemon makes over one job's servers."""

    # -- checkpoints -------------------------------------------------------------------------------
    async def _each(
        self, job_id: int, devices: Sequence[int], call: Callable[[ProxyControl, int], Any]
    ) -> None:
        """Run a control call on each of the job's servers (index i is the job's cuda:i)."""
        live = await self.live_servers(job_id, devices)

        def run() -> None:
            for index, device in live:
                with ProxyControl(self.control(job_id, device)) as proxy:
                    call(proxy, index)

        await asyncio.to_thread(run)

    async def on_servers(
        self,
        job_id: int,
        devices: Sequence[int],
        call: Callable[[ProxyControl, int], Any],
        timeout: float | None = None,
    ) -> list[Any]:
        """Run a control call on each of the job's servers at once (index i is the job's cuda:i);
        the results, by device. The connections wait `timeout` seconds for an answer (None: no
        limit, `call` bounds its own wait)."""
        live = await self.live_servers(job_id, devices)

        def run(index: int, device: int) -> Any:
            with ProxyControl(self.control(job_id, device), timeout=timeout) as proxy:
                return call(proxy, index)

        return list(await asyncio.gather(*(asyncio.to_thread(run, i, d) for i, d in live)))

    async def quiesce_and_save(self, job_id: int, devices: Sequence[int], images: Path) -> None:
        """Stop the job's processes at an operation boundary, then save its live tensors."""
        (images / PROXY_DIR).mkdir(parents=True, exist_ok=True)
        await self._each(job_id, devices, lambda proxy, _: proxy.quiesce(str(job_id)))
        await self.settle(job_id, devices)
        await self._each(
            job_id, devices, lambda proxy, index: proxy.save(str(job_id), device_state_file(images, index))
        )

    async def settle(self, job_id: int, devices: Sequence[int], timeout: float = 60.0) -> None:
        """Ask the job's servers, round after round, until they show a consistent cut (collectives)."""
        deadline = time.monotonic() + timeout
        previous: dict[int, Any] | None = None
        while True:
            current: dict[int, Any] = {}

            def ask(proxy: ProxyControl, index: int, answers: dict[int, Any] = current) -> None:
                answers[index] = proxy.settle(str(job_id), min(5.0, max(0.1, deadline - time.monotonic())))

            await self._each(job_id, devices, ask)
            if cut_reached(previous, current):
                return
            if time.monotonic() > deadline:
                raise ProxyError(
                    f"job {job_id} did not come to rest in {timeout:.0f}s: its processes keep running "
                    "device work or collectives after parking"
                )
            previous = current

    async def resume(self, job_id: int, devices: Sequence[int]) -> None:
        """Let the job's parked processes go on."""
        await self._each(job_id, devices, lambda proxy, _: proxy.resume(str(job_id)))

    async def release(self, job_id: int, devices: Sequence[int]) -> None:
        """Free everything the job holds on these devices."""
        await self._each(job_id, devices, lambda proxy, _: proxy.release(str(job_id)))

    async def preload(self, job_id: int, devices: Sequence[int], images: Path) -> list[dict[str, Any]]:
        """Have the job's servers read the pre-copied records of its device-state files in `images`
        (those `write_precopied_records` kept) into device memory, ahead of `reconnect`; each
        device's answer (ProxyControl.preload) with its "device"."""

        def preload(proxy: ProxyControl, index: int) -> dict[str, Any]:
            records = read_precopied_records(images, index)
            path = device_state_file(images, index)
            if not records or not path.exists():
                nothing = "no pre-copied records"
                return {"device": devices[index], "preloaded_bytes": 0, "seconds": 0.0, "refused": nothing}
            return {"device": devices[index], **proxy.preload(str(job_id), path, records)}

        return await self.on_servers(job_id, devices, preload)

    def reconnect(
        self,
        job_id: int,
        devices: Sequence[int],
        images: Path,
        connections: Sequence[Mapping[str, int]],
        layout: SavedLayout | None = None,
    ) -> Reconnection:
        """Load a checkpoint's tensors into the job's (new) servers and open the connections the
        restored processes will use; returns CRIU's --inherit-fd map and the sockets to close, with
        the device-state bytes loaded and those of them taken preloaded.

        `layout` says how the checkpoint spread its logical devices over its servers (default: the
        same as now). On another number of devices, each saved session is first moved to the slot
        that now serves the logical device its process used (regroup.py).
        The job's servers must have been started (`admit`)."""
        saved = layout or SavedLayout(len(devices), len(devices))
        slots = device_slots(saved.logical, len(devices))
        files: Sequence[Path | None] = [device_state_file(images, index) for index in range(len(devices))]
        if saved.servers != len(devices):
            try:
                sources = [device_state_file(images, index) for index in range(saved.servers)]
                files = regroup(
                    [path if path.exists() else None for path in sources],
                    slots,
                    len(devices),
                    images / PROXY_DIR / f"on-{len(devices)}",
                )
            except (RegroupError, OSError, ValueError) as error:
                why = f"cannot move the job's device state to {counted(len(devices), 'device')}: {error}"
                raise ProxyError(why) from error
        file_bytes = preloaded_bytes = 0
        connected: set[tuple[int, int, int]] | None = set()
        try:
            for index, device in enumerate(devices):
                path = files[index]
                if path is not None and path.exists():
                    with ProxyControl(self.control(job_id, device)) as proxy:
                        loaded = proxy.load(str(job_id), path)
                    file_bytes += int(loaded.get("file_bytes") or 0)
                    preloaded_bytes += int(loaded.get("preloaded_bytes") or 0)
                    said = loaded.get("connected")
                    if connected is not None and said is not None:
                        connected.update((int(r), int(i), int(p)) for r, i, p in said)
                    else:
                        connected = None  # a server that does not say: every process was connected
        finally:
            if saved.servers != len(devices):
                shutil.rmtree(images / PROXY_DIR / f"on-{len(devices)}", ignore_errors=True)
        inherit: dict[str, int] = {}
        opened: list[socket.socket] = []
        try:
            for entry in connections:
                rank, index, process = entry["rank"], entry["index"], entry.get("process", 0)
                if connected is not None and not _was_connected(connected, rank, index, process):
                    log.info(  # CRIU restores the dead connection it dumped as it was
                        "job %d: process %d's connection to cuda:%d had ended before the checkpoint",
                        job_id,
                        process,
                        index,
                    )
                    continue
                connection = open_restored_connection(
                    self.socket_path(job_id, devices[slots[index]]), str(job_id), rank, index, process
                )
                opened.append(connection)
                inherit[f"socket:[{entry['inode']}]"] = connection.fileno()
        except BaseException:
            for connection in opened:
                connection.close()
            raise
        return Reconnection(inherit, opened, file_bytes, preloaded_bytes)

    def status(self, index: int, timeout: float = 2.0) -> dict[str, Any] | None:
        """What the server on this device reports (memory, work done, sessions); None when no job's
        server runs there or it does not answer. Blocking: call it from a thread, never the loop."""
        holder = self.job_on(index)
        if holder is None:
            return None
        try:
            with ProxyControl(self.control(holder, index), timeout=timeout) as proxy:
                return proxy.status()
        except (OSError, EOFError, ControlError, ValueError):
            return None
