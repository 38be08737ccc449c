"""The daemon's device proxies: one server process per device, and their part in checkpoints.

Proxy servers hold every job's device state, so they must outlive a daemon restart just like
jobs do: each is started in its own session, its PID recorded, and a restarted daemon adopts a
server that still answers on its control socket instead of starting another.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from singularity.proxy import bootstrap_path
from singularity.proxy.control import ControlError, ProxyControl, client_sockets, open_restored_connection
from singularityd.devices.inventory import Device
from singularityd.jobs.processes import ProcessWatch

log = logging.getLogger(__name__)

PROXY_DIR = "proxy"


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


def _answers(control: Path) -> bool:
    try:
        with ProxyControl(control, timeout=5.0) as proxy:
            proxy.status()
    except (OSError, ControlError):
        return False
    return True


class ProxyPool:
    """The proxy servers of all devices, started on demand (socket activation).

    The daemon binds each device's socket itself; the first connection a job makes starts the
    server, which inherits the listening socket and accepts the waiting connection. Jobs that
    never touch a device cost no server, and a daemon restart adopts the servers still running.
    """

    def __init__(self, run_dir: Path, state_dir: Path, devices: Sequence[Device], threads: int) -> None:
        self.run_dir = run_dir / PROXY_DIR
        self.state_dir = state_dir / PROXY_DIR
        self.bootstrap = state_dir / "bootstrap"
        self.devices = {device.index: device for device in devices}
        self.threads = threads
        self._listeners: dict[int, socket.socket] = {}
        self._watches: dict[int, ProcessWatch] = {}

    def socket_path(self, device: int) -> Path:
        """The socket jobs on this device connect to."""
        return self.run_dir / f"dev-{device}.sock"

    def control(self, device: int) -> Path:
        """The daemon-only control socket of this device's server."""
        return self.run_dir / f"dev-{device}.sock.ctl"

    @property
    def registry(self) -> Path:
        """Files naming, for each admitted job, the uid allowed to open its proxy sessions."""
        return self.state_dir / "jobs"

    def admit(self, job_id: int, uid: int, devices: Sequence[int]) -> None:
        """Let processes of this uid (and only them) open sessions for the job, on its devices only."""
        temporary = self.registry / f".{job_id}.tmp"
        temporary.write_text(json.dumps({"uid": uid, "devices": list(devices)}))
        temporary.replace(self.registry / str(job_id))

    def forget(self, job_id: int) -> None:
        """The job holds no devices any more: no new sessions for it."""
        (self.registry / str(job_id)).unlink(missing_ok=True)

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
        """Adopt the servers still running from before; arm socket activation for the others."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.run_dir, 0o755)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        self.registry.mkdir(exist_ok=True)
        self.install_bootstrap()
        for index in self.devices:
            pid = self._recorded_pid(index)
            if pid is not None and _answers(self.control(index)):
                log.info("adopted the proxy server of device %d (pid %d)", index, pid)
                self._watch(index, pid)
            else:
                self._arm(index)

    def stop(self) -> None:
        """Stop listening for activations (running servers stay, for the jobs that use them)."""
        loop = asyncio.get_running_loop()
        for listener in self._listeners.values():
            loop.remove_reader(listener.fileno())
            listener.close()
        self._listeners.clear()
        for watch in self._watches.values():
            watch.close()

    def running(self, index: int) -> bool:
        """Whether the device's server has been started (it holds state only then)."""
        return index in self._watches

    def status(self, index: int, timeout: float) -> dict[str, Any]:
        """What the device's running server reports: bytes allocated and each job rank's session."""
        with ProxyControl(self.control(index), timeout=timeout) as proxy:
            return proxy.status()

    def _recorded_pid(self, index: int) -> int | None:
        try:
            return int((self.state_dir / f"dev-{index}.pid").read_text())
        except (OSError, ValueError):
            return None

    def _arm(self, index: int) -> None:
        path = self.socket_path(index)
        path.unlink(missing_ok=True)
        self.control(index).unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        os.chmod(path, 0o666)
        listener.listen(128)
        self._listeners[index] = listener
        asyncio.get_running_loop().add_reader(listener.fileno(), self._activate, index)

    def _activate(self, index: int) -> None:
        """Start the device's server on its (inherited) listening socket."""
        listener = self._listeners.pop(index, None)
        if listener is None:
            return
        asyncio.get_running_loop().remove_reader(listener.fileno())
        device = self.devices[index]
        command = [
            sys.executable, "-m", "singularity.proxy.server",
            "--socket", str(self.socket_path(index)), "--listen-fd", str(listener.fileno()),
            "--device-index", str(index), "--memory-bytes", str(device.memory_total),
            "--name", device.name, "--threads", str(self.threads), "--registry", str(self.registry),
        ]  # fmt: skip
        if device.kind == "nvml":
            command += ["--cuda-device", str(index)]
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
        with open(self.state_dir / f"dev-{index}.log", "ab") as output:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=output,
                start_new_session=True,
                pass_fds=(listener.fileno(),),
                env=env,
                cwd="/",
            )
        listener.close()
        (self.state_dir / f"dev-{index}.pid").write_text(str(process.pid))
        log.info("started the proxy server of device %d (pid %d)", index, process.pid)
        self._watch(index, process.pid)

    def _watch(self, index: int, pid: int) -> None:
        self._watches[index] = ProcessWatch(pid, lambda: self._ended(index, pid))

    def _ended(self, index: int, pid: int) -> None:
        watch = self._watches.pop(index, None)
        if watch is not None:
            watch.close()
        log.warning("the proxy server of device %d (pid %d) ended; listening for the next job", index, pid)
        self._arm(index)

    async def ensure_running(self, index: int) -> None:
        """Start the device's server now if needed, and wait until it answers."""
        if index in self._listeners:
            self._activate(index)
        deadline = time.monotonic() + 120
        while not await asyncio.to_thread(_answers, self.control(index)):
            if index not in self._watches:
                raise ProxyError(f"the proxy server of device {index} ended while starting")
            if time.monotonic() > deadline:
                raise ProxyError(f"the proxy server of device {index} did not start in time")
            await asyncio.sleep(0.05)

    def environment(self, devices: Sequence[int], inherited_pythonpath: str | None) -> dict[str, str]:
        """What a job on these devices needs to find its proxies through the in-job client."""
        paths = [str(self.bootstrap)]
        if inherited_pythonpath:
            paths.append(inherited_pythonpath)
        return {
            "PYTHONPATH": os.pathsep.join(paths),
            "SING_PROXY_SOCKETS": ",".join(str(self.socket_path(d)) for d in devices),
            "CUDA_VISIBLE_DEVICES": "",
        }

    # Checkpoints

    async def _each(self, devices: Sequence[int], call: Callable[[ProxyControl, int, int], Any]) -> None:
        """Run a control call on every running server of a job's devices (index i is cuda:i)."""
        live = [(index, device) for index, device in enumerate(devices) if self.running(device)]

        def run() -> None:
            for index, device in live:
                with ProxyControl(self.control(device)) as proxy:
                    call(proxy, index, device)

        await asyncio.to_thread(run)

    async def quiesce_and_save(self, job_id: int, devices: Sequence[int], images: Path) -> None:
        """Stop the job's processes at an operation boundary, then save its live tensors."""
        images.mkdir(parents=True, exist_ok=True)
        await self._each(devices, lambda proxy, index, _: proxy.quiesce(str(job_id)))
        await self._each(
            devices, lambda proxy, index, _: proxy.save(str(job_id), images / PROXY_DIR / f"cuda{index}")
        )

    async def resume(self, job_id: int, devices: Sequence[int]) -> None:
        """Let the job's parked processes go on."""
        await self._each(devices, lambda proxy, index, _: proxy.resume(str(job_id)))

    async def release(self, job_id: int, devices: Sequence[int]) -> None:
        """Free everything the job holds on these devices."""
        await self._each(devices, lambda proxy, index, _: proxy.release(str(job_id)))

    def reconnect(
        self, job_id: int, devices: Sequence[int], images: Path, connections: Sequence[Mapping[str, int]]
    ) -> tuple[dict[str, int], list[socket.socket]]:
        """Load a checkpoint's tensors into the job's (new) devices and open the connections the
        restored processes will use; returns CRIU's --inherit-fd map and the sockets to close.

        The servers of those devices must be running (`ensure_running`)."""
        for index, device in enumerate(devices):
            saved = images / PROXY_DIR / f"cuda{index}"
            if saved.exists():
                with ProxyControl(self.control(device)) as proxy:
                    proxy.load(str(job_id), saved)
        inherit: dict[str, int] = {}
        opened: list[socket.socket] = []
        try:
            for entry in connections:
                connection = open_restored_connection(
                    self.socket_path(devices[entry["index"]]), str(job_id), entry["rank"], entry["index"]
                )
                opened.append(connection)
                inherit[f"socket:[{entry['inode']}]"] = connection.fileno()
        except BaseException:
            for connection in opened:
                connection.close()
            raise
        return inherit, opened
