"""Entry point of `singularityd`: the command line, config, logging, systemd notify, and the wiring.

Here the parts are chosen and connected: the store, the device inventory, how jobs reach their
devices (the proxies, or directly), checkpoints (CRIU, or the reason there are none), the job
processes (in user namespaces of the daemon's where that lets CRIU checkpoint other users' jobs),
the daemon that drives them, its federation with peer daemons (active once the node is in a lab
cluster), the API that serves the daemon to users, and the observers (metrics, the spool
directory). A changed config file (or SIGHUP) is read again and each live
option handed to the part that uses it (`Running`).
"""

from __future__ import annotations

import os

# Set before gRPC is imported: the daemon forks launchers, whose children always exec.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import argparse
import asyncio
import logging
import signal
import socket
import sys
from dataclasses import replace
from pathlib import Path

from singularityd import __version__
from singularityd.api.server import ApiServer
from singularityd.checkpoint import Checkpointer, CheckpointUnavailable, Criu, ImageStore, locate_criu
from singularityd.checkpoint.coordinator import JobCheckpoints
from singularityd.checkpoint.criu_discovery import CriuInfo
from singularityd.checkpoint.interface import Checkpoints, CriuStatus, NoCheckpoints
from singularityd.checkpoint.precheck import CAP_SYS_RESOURCE, have_capability
from singularityd.checkpoint.restore_guard import FOLDER_NAME, build_restore_guard, load_problem
from singularityd.checkpoint.staging import RECORD_NAME, StagingArea, remove_recorded
from singularityd.config import (
    LIVE_OPTIONS,
    OPTIONS,
    Config,
    ConfigError,
    ConfigSource,
    reload_config,
)
from singularityd.daemon import Daemon
from singularityd.devices.access import DeviceAccess, DirectDevices, PreCopy, ProxiedDevices
from singularityd.devices.inventory import Inventory, discover
from singularityd.devices.proxies import JobProxies
from singularityd.federation.service import Federation
from singularityd.jobs.launch import probe_user_namespaces
from singularityd.jobs.processes import HostProcesses
from singularityd.jobs.splice_watch import SpliceWatch
from singularityd.observe.feed import ConfigReloaded
from singularityd.observe.metrics import DeviceSampler, Metrics
from singularityd.observe.spool import Spool, SpoolRefusal
from singularityd.observe.watch import FolderWatch
from singularityd.requests import Requests
from singularityd.statedir import prepare_state
from singularityd.store import Store, StoreError

log = logging.getLogger("singularityd")


def notify_systemd(message: str) -> None:
    """Send a state line to systemd when it started us with Type=notify (no-op otherwise)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(address)
            sock.sendall(message.encode())
        except OSError as error:
            log.warning("cannot notify systemd at %s: %s", address, error)


def device_access(config: Config, inventory: Inventory) -> DeviceAccess:
    """The daemon's proxy servers when `device_proxy` is on, else the devices themselves."""
    if not config.device_proxy:
        return DirectDevices(nvml=inventory.kind == "nvml")
    pool = JobProxies(
        config.socket.parent,
        config.state_dir,
        inventory.devices,
        config.proxy_threads,
        splice_lean=config.splice_lean,
    )
    return ProxiedDevices(pool)


def staging_area(config: Config, images: ImageStore) -> StagingArea | None:
    """The daemon's memory staging folder for process images (None when off or unusable), after
    removing the one a previous daemon of this image store left."""
    remove_recorded(images.root / RECORD_NAME)
    if not config.checkpoint_staging:
        return None
    try:
        area = StagingArea.open(Path(config.checkpoint_staging), images.root)
    except OSError as error:
        where = config.checkpoint_staging
        log.warning("process images go straight to disk: no staging folder in %s: %s", where, error)
        return None
    log.info("process images of checkpoints in place are staged in %s", area.root)
    return area


def with_restore_guard(info: CriuInfo, folder: Path) -> CriuInfo:
    """`info` with the restore guard built for restores of other users' jobs, or the reason it is not."""
    library, problem = build_restore_guard(folder)
    if not problem:
        problem = load_problem(library, info.argv)
        library = "" if problem else library
    if problem:
        log.warning("other users' jobs are restored without the restore guard: %s", problem)
    return replace(info, restore_guard=library, restore_guard_problem=problem)


async def checkpoints_for(config: Config, devices: DeviceAccess) -> Checkpoints:
    """CRIU checkpoints when a usable CRIU is found, else the reason there are none."""
    try:
        info = await asyncio.to_thread(locate_criu, config.criu)
    except CheckpointUnavailable as error:
        log.warning("checkpoints unavailable: %s", error)
        return NoCheckpoints(CriuStatus("", "", str(error)))
    images = ImageStore(config.checkpoints)
    staging = await asyncio.to_thread(staging_area, config, images)
    if not config.user_mode:
        info = await asyncio.to_thread(with_restore_guard, info, config.state_dir / FOLDER_NAME)
    checkpointer = Checkpointer(
        Criu(info), images, keep=config.checkpoint_keep, pre_copy=config.checkpoint_pre_copy, staging=staging
    )
    log.info("CRIU %s (%s); checkpoints in %s", info.version_text, info.source, config.checkpoints)
    status = CriuStatus(" ".join(info.argv), info.version_text, "", info.restore_guard_problem)
    return JobCheckpoints(checkpointer, devices, status, PreCopy(config.proxy_pre_copy))


async def job_user_namespaces(config: Config, checkpoints: Checkpoints) -> bool:
    """Whether other users' jobs run in user namespaces the daemon owns.

    Only a root daemon with CRIU that lacks CAP_SYS_RESOURCE needs them (CRIU cannot read another
    user's limits without it), and only if `job_user_namespaces` is on and a trial launch works.
    Otherwise the reason is kept for users whose jobs therefore cannot be checkpointed.
    """
    if config.user_mode or not isinstance(checkpoints, JobCheckpoints) or have_capability(CAP_SYS_RESOURCE):
        return False
    problem = "job_user_namespaces is off in the configuration"
    if config.job_user_namespaces:
        trial = await asyncio.to_thread(probe_user_namespaces)
        problem = f"user namespaces do not work here: {trial}" if trial else ""
    checkpoints.checkpointer.userns_problem = problem
    if problem:
        log.warning("other users' jobs cannot be checkpointed: %s", problem)
    else:
        log.info("root lacks CAP_SYS_RESOURCE: other users' jobs run in user namespaces")
    return not problem


async def build_daemon(config: Config) -> Daemon:
    """Take the state directory and connect the daemon's parts (nothing runs yet)."""
    store = Store(config.database)
    inventory = discover(config.devices, config.virtual_devices, config.virtual_device_memory_gib)
    log.info("%d %s device(s); NVML %s", len(inventory.devices), inventory.kind, inventory.nvml_status)
    devices = device_access(config, inventory)
    checkpoints = await checkpoints_for(config, devices)
    processes = HostProcesses(
        config.jobs_dir,
        pid_namespace=not config.user_mode,
        kill_grace_seconds=config.kill_grace_seconds,
        user_namespaces=await job_user_namespaces(config, checkpoints),
        private_network=config.job_network == "private",
    )
    return Daemon(config, store, inventory, processes, checkpoints, devices)


class Running:
    """The daemon's parts while it serves, and how a reloaded config reaches each of them."""

    def __init__(self, source: ConfigSource, daemon: Daemon, api: ApiServer, requests: Requests) -> None:
        self.source = source
        self.config = daemon.config
        self.daemon = daemon
        self.api = api
        self.requests = requests
        pool = daemon.devices.pool if isinstance(daemon.devices, ProxiedDevices) else None
        mode = "user" if self.config.user_mode else "system"
        self.metrics = Metrics(DeviceSampler(daemon.inventory, pool), mode)
        self.metrics.load(daemon.store)
        daemon.feed.observe(self.metrics.observe)
        self.spool: Spool | None = None
        self._config_watch = FolderWatch(source.path.parent, self._config_file_changed)

    def start(self) -> None:
        """Open the metrics endpoint and the spool as configured; watch the config file."""
        self._serve_metrics()
        self._start_spool()
        try:
            self._config_watch.start()
        except OSError as error:
            log.info("not watching %s for changes (%s); SIGHUP reloads it", self.source.path, error)

    def stop(self) -> None:
        """Close the endpoint, stop the spool and the config watch."""
        self._config_watch.stop()
        self.metrics.stop_serving()
        self._stop_spool()

    def _config_file_changed(self, name: str) -> None:
        if name == self.source.path.name:
            self.reload()

    def reload(self) -> None:
        """Read the config file again; apply what may change live, report what needs a restart."""
        try:
            change = reload_config(self.config, self.source)
        except ConfigError as error:
            log.error("config reload failed, keeping the running configuration: %s", error)
            self.daemon.feed.report(ConfigReloaded((), (), str(error)))
            return
        if not change.applied and not change.need_restart:
            log.debug("config file %s read again: nothing changed", self.source.path)
            return
        self.reconfigure(change.config, tuple(change.applied))
        if change.applied:
            log.info("config reloaded from %s: %s", self.source.path, change.describe(change.applied))
        if change.need_restart:
            log.warning(
                "config %s: %s: needs a restart to take effect (the running value stays)",
                self.source.path,
                change.describe(change.need_restart),
            )
        self.daemon.feed.report(ConfigReloaded(tuple(change.applied), tuple(change.need_restart)))

    def reconfigure(self, config: Config, changed: tuple[str, ...]) -> None:
        """Hand each changed live option to the part that uses it."""
        assert set(changed) <= LIVE_OPTIONS
        self.config = config
        self.daemon.config = config  # default checkpoint interval, kill grace backstop
        self.api.reconfigure(config)  # admin group, shutdown grace
        logging.getLogger().setLevel(config.log_level.upper())
        if isinstance(self.daemon.processes, HostProcesses):
            self.daemon.processes.kill_grace_seconds = config.kill_grace_seconds
        if isinstance(self.daemon.checkpoints, JobCheckpoints):
            self.daemon.checkpoints.checkpointer.keep = config.checkpoint_keep
            self.daemon.checkpoints.checkpointer.pre_copy = config.checkpoint_pre_copy
            self.daemon.checkpoints.pre_copy = PreCopy(config.proxy_pre_copy)
        if {"metrics", "metrics_address", "metrics_port"} & set(changed):
            self._serve_metrics()
        if {"spool", "spool_dir"} & set(changed):
            self._stop_spool()
            self._start_spool()

    def _serve_metrics(self) -> None:
        """Open (or move, or close) the metrics endpoint as the config says."""
        config = self.config
        if not config.metrics:
            if self.metrics.address is not None:
                log.info("metrics endpoint closed")
            self.metrics.stop_serving()
            return
        try:
            host, port = self.metrics.serve(config.metrics_address, config.metrics_port)
        except OSError as error:
            log.warning(
                "metrics endpoint off: cannot listen on %s:%d: %s",
                config.metrics_address, config.metrics_port, error.strerror or error,
            )  # fmt: skip
            return
        log.info("metrics on http://%s:%d/metrics", host, port)

    def _start_spool(self) -> None:
        config = self.config
        if not config.spool:
            return
        spool = Spool(config.spool_folder, self.requests.submit, self.daemon.feed.report)
        try:
            spool.start()
        except (OSError, SpoolRefusal) as error:
            spool.stop()
            log.error("spool directory %s off: %s", config.spool_folder, error)
            return
        self.spool = spool
        log.info("spool directory %s: job files dropped there run as their owner", config.spool_folder)

    def _stop_spool(self) -> None:
        if self.spool is not None:
            self.spool.stop()
            self.spool = None


async def serve(source: ConfigSource, config: Config) -> None:
    """Run the daemon until SIGTERM or SIGINT; SIGHUP reads the config file again."""
    locks = prepare_state(config)
    try:
        daemon = await build_daemon(config)
        federation = Federation(daemon, config)
        requests = Requests(daemon, federation=federation)
        api = ApiServer(requests, config)
        running = Running(source, daemon, api, requests)
        await daemon.start()
        daemon.spawn(SpliceWatch(daemon).run())
        await federation.start()
        await api.start()
        running.start()
        log.info("singularityd %s listening on %s", __version__, config.socket)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        loop.add_signal_handler(signal.SIGHUP, running.reload)
        notify_systemd(f"READY=1\nSTATUS=serving on {config.socket}\nMAINPID={os.getpid()}")
        await stop.wait()
        log.info("stopping (running jobs keep running and are re-adopted on restart)")
        notify_systemd("STOPPING=1")
        running.stop()
        await api.stop()
        await federation.stop()
        await daemon.stop()
    finally:
        for lock in locks:
            lock.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The daemon's command line; every flag overrides the config file and environment."""
    parser = argparse.ArgumentParser(
        prog="singularityd",
        description="The singularityd daemon. Options come from defaults, the config file, "
        "SING_* environment variables and these flags, later ones winning.",
    )
    parser.add_argument("--config", type=Path, help="TOML config file (env SING_CONFIG)")
    parser.add_argument("--socket", help="API socket path (env SING_SOCKET)")
    parser.add_argument("--state-dir", help="state directory (env SING_STATE_DIR)")
    parser.add_argument("--devices", choices=["auto", "nvml", "virtual"], help="device source")
    parser.add_argument("--virtual-devices", type=int, help="number of virtual devices")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--show-config", action="store_true", help="print the effective configuration and exit"
    )
    parser.add_argument("--version", action="version", version=f"singularityd {__version__}")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `singularityd`."""
    args = parse_args(argv)
    overrides = {
        "socket": args.socket,
        "state_dir": args.state_dir,
        "devices": args.devices,
        "virtual_devices": args.virtual_devices,
        "log_level": args.log_level,
    }
    source = ConfigSource(args.config, dict(os.environ), overrides)
    try:
        config = source.load()
    except ConfigError as error:
        print(f"singularityd: {error}", file=sys.stderr)
        sys.exit(2)
    if args.show_config:
        for name, doc in OPTIONS.items():
            when = "changes live on reload" if name in LIVE_OPTIONS else "changes need a restart"
            print(f"# {doc} ({when})\n{name} = {getattr(config, name)!r}\n")
        return
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        asyncio.run(serve(source, config))
    except (ConfigError, StoreError, RuntimeError) as error:
        print(f"singularityd: {error}", file=sys.stderr)
        sys.exit(2)
    except PermissionError as error:
        print(f"singularityd: permission denied: {error.filename or error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
