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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from singularity.proxy import bootstrap_path
from singularity.proxy.control import ControlError, ProxyControl
from singularity.proxy.spawner import SpawnerClient, SpawnError, SpawnRequest
from singularityd.core.decisions import describe_exit
from singularityd.devices.inventory import Device
from singularityd.devices.splicing import device_slots
from singularityd.jobs.processes import ProcessWatch, process_start_ticks

log = logging.getLogger(__name__)

PROXY_DIR = "proxy"
LISTEN_FD = 3
CONTROL_FD = 4
PEER_FD_BASE = 10
"""A server's link to the server of the job's device index i is its descriptor PEER_FD_BASE + i."""


class ProxyError(Exception):
    """A proxy server could not be started or did not do what the daemon asked."""


@dataclass(frozen=True)
class JobIdentity:
    """Whom a job's proxy servers run as: the job's user, with the job's groups."""

    uid: int
    gid: int
    groups: tuple[int, ...]


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


@dataclass(frozen=True)
class SpawningServers:
    """The servers of one job being spawned: the task spawning them and the devices they serve (a
    device whose server is not running yet is starting)."""

    task: asyncio.Future[None]
    devices: tuple[int, ...]


def proxy_end(device: int, status: int | None) -> str:
    """How a job's proxy server ended, from its wait status (None: unknown), as its failure says it."""
    server = f"its device proxy (device {device})"
    if status is None:
        return f"{server} ended"
    if os.WIFSIGNALED(status):
        return f"{server} was {describe_exit(None, os.WTERMSIG(status))}"
    return f"{server} {describe_exit(os.waitstatus_to_exitcode(status), None)}"


@dataclass
class LostServer:
    """A job's server that ended while the job held it: which device, and how it ended once known."""

    device: int
    how: str


class ProxyServers:
    """The proxy servers of every job: started with the job, stopped with it, adopted on restart."""

    def __init__(
        self,
        run_dir: Path,
        state_dir: Path,
        devices: Sequence[Device],
        threads: int,
        spawner: Callable[[], SpawnerClient] = SpawnerClient,
        splice_lean: bool = True,
    ) -> None:
        self.run_dir = run_dir / PROXY_DIR
        self.state_dir = state_dir / PROXY_DIR
        self.bootstrap = state_dir / "bootstrap"
        self.devices = {device.index: device for device in devices}
        self.threads = threads
        self.splice_lean = splice_lean
        """Whether the servers make spliced ranks take turns and wait in host memory."""
        self._make_spawner = spawner
        self._spawner: concurrent.futures.Future[SpawnerClient] | None = None
        self._watches: dict[tuple[int, int], ProcessWatch] = {}
        self._starting: dict[int, SpawningServers] = {}
        """Jobs whose servers are being spawned (forgetting a job makes late ones stop)."""
        self._lost: dict[int, LostServer] = {}
        """The first server of each job that ended while the job held it."""
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
        return any(
            device in spawning.devices and not self.running(job_id, device)
            for job_id, spawning in self._starting.items()
        )

    def job_on(self, device: int) -> int | None:
        """The job whose server runs on this device (None: none does)."""
        return next((job_id for job_id, index in self._watches if index == device), None)

    async def live_servers(self, job_id: int, devices: Sequence[int]) -> list[tuple[int, int]]:
        """The job's servers that run, as (index, device) with index i the job's cuda:i, once those
        being spawned are."""
        spawning = self._spawning_task(job_id)
        if spawning is not None:
            await asyncio.shield(spawning)
        return [(index, device) for index, device in enumerate(devices) if self.running(job_id, device)]

    def _spawning_task(self, job_id: int) -> asyncio.Future[None] | None:
        """The task spawning the job's servers, if they are being spawned."""
        spawning = self._starting.get(job_id)
        return spawning.task if spawning is not None else None

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
        task = asyncio.ensure_future(self._spawn_servers(job_id, identity, temporary, bound, links))
        self._starting[job_id] = SpawningServers(task, tuple(devices))

        def done(finished: asyncio.Future[None]) -> None:
            if self._spawning_task(job_id) is finished:
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
        except (SpawnError, OSError) as error:
            log.error("job %d: cannot start its proxy servers: %s", job_id, error)
        finally:
            if self._spawning_task(job_id) is asyncio.current_task():
                del self._starting[job_id]  # a device that did not start is no longer starting
            for _, _, data, control in bound:
                data.close()
                control.close()
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
            "--splice-lean" if self.splice_lean else "--no-splice-lean",
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
        lost = LostServer(device, proxy_end(device, None))
        self._lost.setdefault(job_id, lost)
        spawner = self._spawner
        if spawner is None or not spawner.done() or spawner.exception() is not None:
            log.warning("job %d: the proxy server of device %d (pid %d) ended", job_id, device, pid)
            return

        def learned(asked: asyncio.Future[int | None]) -> None:
            status = None if asked.cancelled() or asked.exception() is not None else asked.result()
            lost.how = proxy_end(device, status)
            log.warning("job %d: %s (pid %d)", job_id, lost.how, pid)

        asked = asyncio.get_running_loop().run_in_executor(None, spawner.result().ended, pid)
        asked.add_done_callback(learned)

    def lost(self, job_id: int) -> str:
        """How the first of the job's servers that ended while the job held it ended ('' if none did)."""
        lost = self._lost.get(job_id)
        return lost.how if lost is not None else ""

    def forget(self, job_id: int) -> None:
        """Stop the job's servers and remove everything they had: sockets, temporary files, records."""
        self._starting.pop(job_id, None)
        self._lost.pop(job_id, None)
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
