"""The daemon's device proxies: one server process per job and device, with that job's privileges.

A proxy server runs the job's device work, so it holds no more privilege than the job's user: the
daemon asks its spawner (proxy/spawner.py, a warm root process) to fork each server as the job's
uid and gids, with no capability, no way to gain one, not dumpable, in a private temporary folder.
Only the job's user can open the job's device sockets (the kernel checks the socket's owner and
mode), and the daemon's control channel is a socket in a folder only root can enter, whose
listening descriptor the server inherits. A server serves one job and ends with it, so nothing a
job leaves on a device reaches the next. Servers outlive a daemon restart, like jobs: each is
recorded with its PID and start time, and a restarted daemon adopts those that still answer.

Layout:
    <socket dir>/proxy/                   root, 0755
        job-<id>/                         root, 0711
            dev-<i>.sock                  the job's user, 0600: the server of device i listens here
            cuda-<j>.sock                 -> dev-<i>.sock: the job's cuda:j, served by device i (splicing.py)
            tmp/                          the job's user, 0700: TMPDIR of the job's servers
    <state>/proxy/                        root, 0700
        control/job-<id>-dev-<i>.sock     the daemon's control channel to one server
        servers/job-<id>-dev-<i>.json     who serves it (pid, start ticks), for adoption
        logs/job-<id>-dev-<i>.log         the server's own output
    <state>/bootstrap/                    the in-job client, readable by every user
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from singularity.proxy import bootstrap_path
from singularity.proxy.control import (
    ControlError,
    ProxyControl,
    client_sockets,
    cut_reached,
    open_restored_connection,
)
from singularity.proxy.spawner import SpawnerClient, SpawnError, SpawnRequest
from singularityd.devices.inventory import Device
from singularityd.devices.regroup import RegroupError, regroup, session_slots
from singularityd.devices.splicing import SavedLayout, device_slots
from singularityd.jobs.processes import ProcessWatch, process_start_ticks

log = logging.getLogger(__name__)

PROXY_DIR = "proxy"
STATE_FILE_SUFFIX = ".state"
LISTEN_FD = 3
CONTROL_FD = 4
PEER_FD_BASE = 10
"""A server's link to the server of the job's device index i is its descriptor PEER_FD_BASE + i."""


class ProxyError(Exception):
    """A proxy server could not be started or did not do what the daemon asked."""


@dataclass(frozen=True)
class ProxyConnection:
    """One job process's connection to one of its devices, as found before a dump."""

    pid: int
    rank: int
    index: int
    inode: int

    def as_dict(self) -> dict[str, int]:
        """JSON form, kept in the checkpoint's manifest."""
        return {"pid": self.pid, "rank": self.rank, "index": self.index, "inode": self.inode}


@dataclass(frozen=True)
class JobIdentity:
    """Whom a job's proxy servers run as: the job's user, with the job's groups."""

    uid: int
    gid: int
    groups: tuple[int, ...]


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
    """Every proxy connection held by the given processes of a job."""
    found = []
    for pid in pids:
        try:
            sockets = client_sockets(pid)
        except OSError:
            continue
        rank = _rank_of(pid) if sockets else 0
        found += [ProxyConnection(pid, rank, index, inode) for index, (_, inode) in sorted(sockets.items())]
    return found


def device_state_file(images: Path, index: int) -> Path:
    """Where a checkpoint keeps the device state of the job's device `index` (cuda:index)."""
    return images / PROXY_DIR / f"cuda{index}{STATE_FILE_SUFFIX}"


def _answers(control: Path) -> bool:
    try:
        with ProxyControl(control, timeout=5.0) as proxy:
            proxy.status()
    except (OSError, ControlError):
        return False
    return True


def _listening_socket(path: Path, owner: tuple[int, int] | None, mode: int) -> socket.socket:
    """A Unix socket listening at `path` (replacing a stale one), owned and moded as asked."""
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        if owner is not None:
            os.chown(path, *owner)
        os.chmod(path, mode)
        listener.listen(128)
    except BaseException:
        listener.close()
        raise
    return listener


def _private_folder(path: Path, owner: tuple[int, int] | None, mode: int) -> None:
    """Create `path` (a fresh, real folder) with this owner and mode."""
    if path.is_symlink():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    if owner is not None:
        os.chown(path, *owner)
    os.chmod(path, mode)


def peer_links(count: int) -> dict[tuple[int, int], socket.socket]:
    """A socketpair for every pair of a job's devices: {(i, j): the end server i holds to reach j}.

    The servers of a job carry out its collectives over these links; only they hold the ends."""
    links: dict[tuple[int, int], socket.socket] = {}
    for i in range(count):
        for j in range(i + 1, count):
            links[(i, j)], links[(j, i)] = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return links


class JobProxies:
    """The proxy servers of every job: started with the job, stopped with it, adopted on restart."""

    def __init__(
        self,
        run_dir: Path,
        state_dir: Path,
        devices: Sequence[Device],
        threads: int,
        spawner: Callable[[], SpawnerClient] = SpawnerClient,
    ) -> None:
        self.run_dir = run_dir / PROXY_DIR
        self.state_dir = state_dir / PROXY_DIR
        self.bootstrap = state_dir / "bootstrap"
        self.devices = {device.index: device for device in devices}
        self.threads = threads
        self._make_spawner = spawner
        self._spawner: concurrent.futures.Future[SpawnerClient] | None = None
        self._watches: dict[tuple[int, int], ProcessWatch] = {}
        self._starting: dict[int, asyncio.Future[None]] = {}
        """Jobs whose servers are being spawned (forgetting a job makes late ones stop)."""
        self._unspawned: set[tuple[int, int]] = set()
        """The (job, device) servers whose sockets are bound but which are not spawned yet."""
        self._owner_mode = os.geteuid() == 0

    # -- places -------------------------------------------------------------------------------------
    def job_dir(self, job_id: int) -> Path:
        """The folder of the job's device sockets and private temporary folder."""
        return self.run_dir / f"job-{job_id}"

    def socket_path(self, job_id: int, device: int) -> Path:
        """The socket the server of one of the job's devices listens on."""
        return self.job_dir(job_id) / f"dev-{device}.sock"

    def logical_path(self, job_id: int, logical: int) -> Path:
        """The socket the job's processes connect to for their cuda:`logical` (a link to its server's)."""
        return self.job_dir(job_id) / f"cuda-{logical}.sock"

    def control(self, job_id: int, device: int) -> Path:
        """The daemon-only control socket of the job's server for one device."""
        return self.state_dir / "control" / f"job-{job_id}-dev-{device}.sock"

    def _record(self, job_id: int, device: int) -> Path:
        return self.state_dir / "servers" / f"job-{job_id}-dev-{device}.json"

    def _log(self, job_id: int, device: int) -> Path:
        return self.state_dir / "logs" / f"job-{job_id}-dev-{device}.log"

    # -- start and stop ----------------------------------------------------------------------------
    def install_bootstrap(self) -> Path:
        """Copy the in-job client where every user can read it (the checkout may be private)."""
        fresh = self.bootstrap.with_name("bootstrap.new")
        shutil.rmtree(fresh, ignore_errors=True)
        shutil.copytree(bootstrap_path(), fresh, ignore=shutil.ignore_patterns("__pycache__"))
        for folder, _, files in os.walk(fresh):
            os.chmod(folder, 0o755)
            for name in files:
                os.chmod(Path(folder) / name, 0o644)
        shutil.rmtree(self.bootstrap, ignore_errors=True)
        fresh.rename(self.bootstrap)
        return self.bootstrap

    def start(self) -> None:
        """Create the folders, start the spawner and adopt the servers a previous daemon started."""
        _private_folder(self.run_dir, None, 0o755)
        _private_folder(self.state_dir, None, 0o700)
        for sub in ("control", "servers", "logs"):
            _private_folder(self.state_dir / sub, None, 0o700)
        self.install_bootstrap()
        self._spawner = concurrent.futures.ThreadPoolExecutor(1).submit(self._make_spawner)
        for record in sorted((self.state_dir / "servers").glob("job-*-dev-*.json")):
            self._adopt(record)

    def _adopt(self, record: Path) -> None:
        try:
            facts = json.loads(record.read_text())
            job_id, device, pid, ticks = (int(facts[k]) for k in ("job", "device", "pid", "ticks"))
        except (OSError, ValueError, KeyError, TypeError):
            record.unlink(missing_ok=True)
            return
        if process_start_ticks(pid) == ticks and _answers(self.control(job_id, device)):
            log.info("adopted the proxy server of job %d on device %d (pid %d)", job_id, device, pid)
            self._watch(job_id, device, pid)
        else:
            record.unlink(missing_ok=True)

    def stop(self) -> None:
        """Stop the spawner and watching (servers stay, for the jobs that use them)."""
        for watch in self._watches.values():
            watch.close()
        self._watches.clear()
        if self._spawner is not None:
            with contextlib.suppress(Exception):
                self._spawner.result().close()
            self._spawner = None

    def running(self, job_id: int, device: int) -> bool:
        """Whether the job has a server for this device."""
        return (job_id, device) in self._watches

    def serving(self, device: int) -> bool:
        """Whether some job's server runs on this device."""
        return any(index == device for _, index in self._watches)

    def starting(self, device: int) -> bool:
        """Whether a job's server for this device is bound (its job may connect) but not spawned yet."""
        return any(index == device for _, index in self._unspawned)

    def jobs(self) -> set[int]:
        """The jobs that have servers."""
        return {job_id for job_id, _ in self._watches}

    # -- a job's servers ---------------------------------------------------------------------------
    async def admit(
        self, job_id: int, identity: JobIdentity, devices: Sequence[int], logical: int | None = None
    ) -> None:
        """Start the job's servers, one per device, as the job's user (replacing any left over),
        serving the `logical` devices its processes see (default: one each; splicing.py).

        The sockets are bound at once, so the job may start and connect right away: its
        connections wait in the sockets' backlog until the servers, spawned in the background,
        accept them. If a server cannot start, its sockets are closed and the job's
        connections fail instead of waiting.
        """
        if self._spawner is None:
            raise ProxyError("the proxy servers are not started")
        self.forget(job_id)
        owner = (identity.uid, identity.gid) if self._owner_mode else None
        _private_folder(self.job_dir(job_id), None, 0o711)
        temporary = self.job_dir(job_id) / "tmp"
        _private_folder(temporary, owner, 0o700)
        bound: list[tuple[int, int, socket.socket, socket.socket]] = []
        links = peer_links(len(devices))
        try:
            for index, device in enumerate(devices):
                data = _listening_socket(self.socket_path(job_id, device), owner, 0o600)
                control = _listening_socket(self.control(job_id, device), None, 0o600)
                bound.append((index, device, data, control))
            slots = device_slots(logical or len(devices), len(devices))
            for seen, slot in enumerate(slots):
                self.logical_path(job_id, seen).symlink_to(self.socket_path(job_id, devices[slot]).name)
        except BaseException:
            for _, _, data, control in bound:
                data.close()
                control.close()
            for sock in links.values():
                sock.close()
            self.forget(job_id)
            raise
        self._unspawned.update((job_id, device) for device in devices)
        task = asyncio.ensure_future(self._spawn_servers(job_id, identity, temporary, bound, links))
        self._starting[job_id] = task

        def done(finished: asyncio.Future[None]) -> None:
            if self._starting.get(job_id) is finished:
                del self._starting[job_id]

        task.add_done_callback(done)

    async def _spawn_servers(
        self,
        job_id: int,
        identity: JobIdentity,
        temporary: Path,
        bound: list[tuple[int, int, socket.socket, socket.socket]],
        links: dict[tuple[int, int], socket.socket],
    ) -> None:
        """Spawn the server of each bound device; close each device's sockets once handed over."""
        try:
            assert self._spawner is not None
            spawner = await asyncio.wrap_future(self._spawner)
            for index, device, data, control in bound:
                peers = {j: sock for (i, j), sock in links.items() if i == index}
                request = self._request(job_id, identity, index, device, temporary, data, control, peers)
                pid = await asyncio.to_thread(self._spawn_and_record, spawner, request, job_id, device)
                data.close()
                control.close()
                for sock in peers.values():
                    sock.close()
                self._note_started(job_id, device, pid, identity.uid)
                self._unspawned.discard((job_id, device))
        except (SpawnError, OSError) as error:
            log.error("job %d: cannot start its proxy servers: %s", job_id, error)
        finally:
            current = self._starting.get(job_id) is asyncio.current_task()
            for _, device, data, control in bound:
                data.close()
                control.close()
                if current:
                    self._unspawned.discard((job_id, device))
            for sock in links.values():
                sock.close()

    def _request(
        self,
        job_id: int,
        identity: JobIdentity,
        index: int,
        device: int,
        temporary: Path,
        data: socket.socket,
        control: socket.socket,
        peers: Mapping[int, socket.socket],
    ) -> SpawnRequest:
        """What the spawner is asked for to start the server of one device of the job."""
        spec = self.devices[device]
        argv = [
            "--socket", str(self.socket_path(job_id, device)), "--listen-fd", str(LISTEN_FD),
            "--control-fd", str(CONTROL_FD), "--device-index", str(index),
            "--memory-bytes", str(spec.memory_total), "--name", spec.name, "--threads", str(self.threads),
            "--job-id", str(job_id), "--job-uid", str(identity.uid), "--daemon-uid", str(os.geteuid()),
        ]  # fmt: skip
        if spec.kind == "nvml":
            argv += ["--cuda-device", str(device)]
        if peers:
            argv += ["--peer-fds", ",".join(f"{j}:{PEER_FD_BASE + j}" for j in sorted(peers))]
        fds = {LISTEN_FD: data.fileno(), CONTROL_FD: control.fileno()}
        fds.update({PEER_FD_BASE + j: sock.fileno() for j, sock in peers.items()})
        return SpawnRequest(
            module="singularity.proxy.server",
            argv=argv,
            uid=identity.uid,
            gid=identity.gid,
            groups=identity.groups,
            env={"OMP_NUM_THREADS": str(self.threads), "TMPDIR": str(temporary), "HOME": str(temporary)},
            fds=fds,
            log_path=str(self._log(job_id, device)),
        )

    def _spawn_and_record(
        self, spawner: SpawnerClient, request: SpawnRequest, job_id: int, device: int
    ) -> int:
        """Spawn one server and record it at once, in the same thread: a daemon stopped meanwhile
        (which cancels the task awaiting this thread, not the thread) leaves no unrecorded server
        behind, so the next daemon adopts it or stops it."""
        pid = spawner.spawn(request)
        record = self._record(job_id, device)
        temporary_record = record.with_suffix(".tmp")
        ticks = process_start_ticks(pid) or 0
        temporary_record.write_text(json.dumps({"job": job_id, "device": device, "pid": pid, "ticks": ticks}))
        temporary_record.replace(record)
        return pid

    def _note_started(self, job_id: int, device: int, pid: int, uid: int) -> None:
        """Watch a server that started and was recorded (or stop it, if its job was forgotten
        meanwhile)."""
        if job_id not in self._starting:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self._record(job_id, device).unlink(missing_ok=True)
            return
        log.info("job %d: proxy server of device %d started as uid %d (pid %d)", job_id, device, uid, pid)
        self._watch(job_id, device, pid)

    def _watch(self, job_id: int, device: int, pid: int) -> None:
        self._watches[(job_id, device)] = ProcessWatch(pid, lambda: self._ended(job_id, device, pid))

    def _ended(self, job_id: int, device: int, pid: int) -> None:
        watch = self._watches.pop((job_id, device), None)
        if watch is None:
            return  # stopped on purpose
        watch.close()
        self._record(job_id, device).unlink(missing_ok=True)
        log.warning("job %d: the proxy server of device %d (pid %d) ended", job_id, device, pid)

    def forget(self, job_id: int) -> None:
        """Stop the job's servers and remove everything they had: sockets, temporary files, records."""
        self._starting.pop(job_id, None)
        self._unspawned = {key for key in self._unspawned if key[0] != job_id}
        for job, device in [key for key in self._watches if key[0] == job_id]:
            watch = self._watches.pop((job, device))
            watch.signal(signal.SIGKILL)
            watch.close()
        for record in (self.state_dir / "servers").glob(f"job-{job_id}-dev-*.json"):
            record.unlink(missing_ok=True)
        for control in (self.state_dir / "control").glob(f"job-{job_id}-dev-*.sock"):
            control.unlink(missing_ok=True)
        shutil.rmtree(self.job_dir(job_id), ignore_errors=True)

    def retain(self, job_ids: set[int]) -> None:
        """Stop the servers of every job not named (those a previous daemon left for ended jobs)."""
        for job_id in self.jobs() - job_ids:
            log.info("job %d no longer holds devices: stopping its proxy servers", job_id)
            self.forget(job_id)

    def environment(
        self,
        job_id: int,
        devices: Sequence[int],
        inherited_pythonpath: str | None,
        logical: int | None = None,
    ) -> dict[str, str]:
        """What a job's processes need to reach their servers through the in-job client: one socket
        per device they see (`logical`, default one per device held), each a link to its server's."""
        paths = [str(self.bootstrap)]
        if inherited_pythonpath:
            paths.append(inherited_pythonpath)
        return {
            "PYTHONPATH": os.pathsep.join(paths),
            "SING_PROXY_SOCKETS": ",".join(
                str(self.logical_path(job_id, seen)) for seen in range(logical or len(devices))
            ),
            "CUDA_VISIBLE_DEVICES": "",
        }

    # -- checkpoints -------------------------------------------------------------------------------
    async def _each(
        self, job_id: int, devices: Sequence[int], call: Callable[[ProxyControl, int], Any]
    ) -> None:
        """Run a control call on each of the job's servers (index i is the job's cuda:i)."""
        starting = self._starting.get(job_id)
        if starting is not None:
            await asyncio.shield(starting)
        live = [(index, device) for index, device in enumerate(devices) if self.running(job_id, device)]

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
        starting = self._starting.get(job_id)
        if starting is not None:
            await asyncio.shield(starting)
        live = [(index, device) for index, device in enumerate(devices) if self.running(job_id, device)]

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

    def reconnect(
        self,
        job_id: int,
        devices: Sequence[int],
        images: Path,
        connections: Sequence[Mapping[str, int]],
        layout: SavedLayout | None = None,
    ) -> tuple[dict[str, int], list[socket.socket]]:
        """Load a checkpoint's tensors into the job's (new) servers and open the connections the
        restored processes will use; returns CRIU's --inherit-fd map and the sockets to close.

        `layout` says how the checkpoint spread its logical devices over its servers (default: the
        same as now). On another number of devices, each saved session is first moved to the slot
        that now serves the logical device its process used (regroup.py).
        The job's servers must have been started (`admit`)."""
        saved = layout or SavedLayout(len(devices), len(devices))
        slots = device_slots(saved.logical, len(devices))
        files: Sequence[Path | None] = [device_state_file(images, index) for index in range(len(devices))]
        if saved.servers != len(devices):
            try:
                moves = session_slots(connections, device_slots(saved.logical, saved.servers), slots)
                sources = [device_state_file(images, index) for index in range(saved.servers)]
                files = regroup(
                    [path if path.exists() else None for path in sources],
                    moves,
                    len(devices),
                    images / PROXY_DIR / f"on-{len(devices)}",
                )
            except (RegroupError, OSError, ValueError) as error:
                why = f"cannot move the job's device state to {len(devices)} devices: {error}"
                raise ProxyError(why) from error
        try:
            for index, device in enumerate(devices):
                path = files[index]
                if path is not None and path.exists():
                    with ProxyControl(self.control(job_id, device)) as proxy:
                        proxy.load(str(job_id), path)
        finally:
            if saved.servers != len(devices):
                shutil.rmtree(images / PROXY_DIR / f"on-{len(devices)}", ignore_errors=True)
        inherit: dict[str, int] = {}
        opened: list[socket.socket] = []
        try:
            for entry in connections:
                connection = open_restored_connection(
                    self.socket_path(job_id, devices[slots[entry["index"]]]),
                    str(job_id),
                    entry["rank"],
                    entry["index"],
                )
                opened.append(connection)
                inherit[f"socket:[{entry['inode']}]"] = connection.fileno()
        except BaseException:
            for connection in opened:
                connection.close()
            raise
        return inherit, opened

    def status(self, index: int, timeout: float = 2.0) -> dict[str, Any] | None:
        """What the server on this device reports (memory, work done, sessions); None when no job's
        server runs there or it does not answer. Blocking: call it from a thread, never the loop."""
        holders = [job_id for job_id, device in self._watches if device == index]
        if not holders:
            return None  # no job's server runs there
        try:
            with ProxyControl(self.control(holders[0], index), timeout=timeout) as proxy:
                return proxy.status()
        except (OSError, EOFError, ControlError, ValueError):
            return None
