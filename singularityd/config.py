"""Daemon configuration: embedded defaults, then a TOML file, then environment, then flags.

Every option has a documented default (`OPTIONS`), so the daemon starts with no file at all.
Run as root it is a system daemon (socket under /run, state under /var/lib); run as any other
user it works in user mode, under that user's XDG directories.
"""

from __future__ import annotations

import os
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from singularityd.federation.membership import parse_seed

SYSTEM_CONFIG = Path("/etc/singularity/singularityd.toml")
SYSTEM_SOCKET = Path("/run/singularity/sing.sock")
SYSTEM_STATE_DIR = Path("/var/lib/singularity")


class ConfigError(Exception):
    """The configuration cannot be used; the message says which file or value and why."""


def user_runtime_dir(uid: int) -> Path:
    """Where a non-root user's sockets live: $XDG_RUNTIME_DIR, else a private /tmp folder."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "singularity"
    return Path(f"/tmp/singularity-{uid}")


def user_state_dir() -> Path:
    """Where a non-root user's daemon keeps its state: $XDG_STATE_HOME/singularity."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "singularity"


def user_config_file() -> Path:
    """A non-root user's config file: $XDG_CONFIG_HOME/singularity/singularityd.toml."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "singularity" / "singularityd.toml"


def default_socket(uid: int) -> Path:
    """The socket a daemon of this uid listens on by default."""
    return SYSTEM_SOCKET if uid == 0 else user_runtime_dir(uid) / "sing.sock"


def default_config_file(uid: int) -> Path:
    """The config file a daemon of this uid reads by default (missing is fine)."""
    return SYSTEM_CONFIG if uid == 0 else user_config_file()


@dataclass(frozen=True)
class Config:
    """All settings of one daemon; see OPTIONS for what each means and its default."""

    socket: Path
    state_dir: Path
    devices: str = "auto"
    virtual_devices: int = 4
    virtual_device_memory_gib: float = 16.0
    admin_group: str = "singularity-admin"
    premium_group: str = ""
    kill_grace_seconds: float = 10.0
    shutdown_grace_seconds: float = 5.0
    criu: str = "auto"
    checkpoint_interval_seconds: float = 0.0
    elastic_grow_seconds: float = 5.0
    splice_verdict_seconds: float = 1.0
    checkpoint_keep: int = 2
    checkpoint_pre_copy: int = 1
    checkpoint_dir: Path | None = None
    checkpoint_staging: str = ""
    device_proxy: bool = True
    proxy_threads: int = 1
    proxy_pre_copy: int = 2
    splice_lean: bool = True
    job_user_namespaces: bool = True
    job_network: str = "host"
    log_level: str = "info"
    metrics: bool = True
    metrics_address: str = "127.0.0.1"
    metrics_port: int = 9470
    spool: bool = True
    spool_dir: Path | None = None
    node_name: str = ""
    cluster_dir: Path | None = None
    peer_address: str = "0.0.0.0"
    peer_port: int = 7070
    join_port: int = 7071
    peer_advertise: str = ""
    peers: tuple[str, ...] = ()
    submit_anywhere: bool = False
    heartbeat_seconds: float = 2.0
    peer_keepalive_seconds: float = 20.0
    move_timeout_seconds: float = 600.0
    move_hold_seconds: float = 900.0
    move_connect_seconds: float = 10.0
    move_process_base: bool = True
    move_preload: bool = True

    @property
    def user_mode(self) -> bool:
        """True when the daemon runs without root: jobs run as the daemon's own user only."""
        return os.geteuid() != 0

    @property
    def database(self) -> Path:
        """The SQLite file holding jobs, events and device assignments."""
        return self.state_dir / "singularity.db"

    @property
    def jobs_dir(self) -> Path:
        """Per-job folders: logs, status files and launch specs."""
        return self.state_dir / "jobs"

    @property
    def checkpoints(self) -> Path:
        """Where checkpoint images are kept: checkpoint_dir, else <state_dir>/checkpoints."""
        return self.checkpoint_dir or self.state_dir / "checkpoints"

    @property
    def spool_folder(self) -> Path:
        """Where job files are dropped: spool_dir, else <state_dir>/spool."""
        return self.spool_dir or self.state_dir / "spool"

    @property
    def cluster_folder(self) -> Path:
        """The node's lab PKI (CA certificate, its key and certificate): cluster_dir, else
        <state_dir>/cluster."""
        return self.cluster_dir or self.state_dir / "cluster"

    @property
    def host_name(self) -> str:
        """This machine's name as a node name: node_name, else the host name (first label, lower case)."""
        return self.node_name or socket.gethostname().split(".")[0].lower()

    @property
    def advertised_address(self) -> str:
        """Where peers reach this node: peer_advertise, else the host name and peer_port."""
        return self.peer_advertise or f"{socket.gethostname()}:{self.peer_port}"

    @property
    def internal_socket_dir(self) -> Path:
        """Private sockets of the per-user API servers, reachable only by the daemon."""
        return self.socket.parent / ".internal"


OPTIONS: dict[str, str] = {
    "socket": "Unix socket of the API (root: /run/singularity/sing.sock; "
    "users: $XDG_RUNTIME_DIR/singularity/sing.sock). Env SING_SOCKET, flag --socket.",
    "state_dir": "Jobs database, logs and checkpoints (root: /var/lib/singularity; "
    "users: $XDG_STATE_HOME/singularity). Env SING_STATE_DIR, flag --state-dir.",
    "devices": "'auto' (NVIDIA GPUs through NVML when present, else virtual), 'nvml' or "
    "'virtual'. Env SING_DEVICES, flag --devices.",
    "virtual_devices": "How many CPU-backed virtual devices to offer (default 4). "
    "Env SING_VIRTUAL_DEVICES, flag --virtual-devices.",
    "virtual_device_memory_gib": "Memory capacity of each virtual device in GiB (default 16).",
    "admin_group": "Unix group whose members may act on any job (default singularity-admin); "
    "root always may.",
    "premium_group": "Unix group whose members may submit premium-tier jobs (root and admin_group "
    "members always may); empty (the default): any user may.",
    "kill_grace_seconds": "Time between SIGTERM and SIGKILL when a job is cancelled (default 10).",
    "shutdown_grace_seconds": "Time the daemon gives in-flight requests on SIGTERM (default 5).",
    "criu": "'auto' (criu on PATH if `criu check` passes, else the private copy in the venv) "
    "or a path to a criu binary.",
    "checkpoint_interval_seconds": "Default periodic checkpoint interval; 0 disables (default 0).",
    "elastic_grow_seconds": "How long devices stay idle, with no job waiting, before elastic jobs "
    "(--min-gpus/--max-gpus) grow into them (default 5), so a device freed for a moment is not "
    "taken and given back at once.",
    "splice_verdict_seconds": "How often the proxy servers of each job whose ranks share devices are "
    "asked whether those ranks are data-parallel replicas (a status read per device; default 1). A "
    "job refused stops sharing devices at most this long after its servers decide.",
    "checkpoint_keep": "How many complete checkpoints to keep per job (default 2).",
    "checkpoint_pre_copy": "Pre-copy rounds (CRIU pre-dumps while the job runs) before the final "
    "dump, so the pause grows with dirtied memory only; 0 disables (default 1).",
    "checkpoint_dir": "Where checkpoint images are kept (default <state_dir>/checkpoints).",
    "checkpoint_staging": "A tmpfs where CRIU writes the process images of a checkpoint taken in "
    "place, so the job's freeze lasts a memory copy, not a disk write; they are moved into "
    "checkpoint_dir once the job runs again, and the checkpoint counts from then. The daemon keeps a "
    "root-only folder there; a dump it has no room for goes straight to disk. Default '' (off: "
    "measured here, the page cache took CRIU's writes as fast as a tmpfs; staging helps where the "
    "kernel throttles writers of a disk with much dirty data). Example: /dev/shm.",
    "device_proxy": "Serve devices to jobs through per-device proxy servers, so job processes hold no "
    "device state (default true); false gives jobs their GPUs directly (CUDA_VISIBLE_DEVICES).",
    "proxy_threads": "Intra-op CPU threads of each proxy server (default 1); a job's results match a "
    "direct CPU run with the same OMP_NUM_THREADS.",
    "splice_lean": "Ranks spliced on one device take turns up to their collectives and wait there "
    "with what they alone hold in host memory, and update what they share a few operations apart "
    "(default true: 4 spliced Adam ranks peak at 1.3-1.5x one rank's device memory instead of "
    "about 2x); false lets them run side by side, faster where the device has the memory (their "
    "steps took 12-15% less time here, about 30% less for steps of a few milliseconds). Takes effect "
    "for jobs started after a restart.",
    "proxy_pre_copy": "Rounds of pre-copy of a job's device state by its proxy servers while it runs, "
    "before a checkpoint's pause, so the pause copies only what the job wrote meanwhile (default 2; "
    "0: everything is copied in the pause).",
    "job_user_namespaces": "Where root lacks CAP_SYS_RESOURCE (some containers and VMs), run other "
    "users' jobs in a user namespace owned by the daemon, so CRIU can checkpoint them (default true; "
    "used only when a trial at start-up works).",
    "job_network": "'host' (jobs share the machine's network, default) or 'private' (each job gets a "
    "network namespace with only a loopback device: no outside network, but the TCP connections "
    "between its ranks can be checkpointed even in a user namespace).",
    "log_level": "debug, info, warning or error (default info). Env SING_LOG_LEVEL.",
    "metrics": "Serve Prometheus metrics over HTTP at metrics_address:metrics_port/metrics (default true).",
    "metrics_address": "Address the metrics endpoint listens on (default 127.0.0.1: this machine only).",
    "metrics_port": "TCP port of the metrics endpoint (default 9470; 0: any free port, logged).",
    "spool": "Watch spool_dir for job files and submit each as its file's owner (default true).",
    "spool_dir": "Folder watched for job files (default <state_dir>/spool, created mode 1733 like "
    "cron's crontabs: anyone may drop a file, nobody else may list, replace or remove it).",
    "node_name": "This machine's name in a lab cluster, used by `sing cluster init/join` (default: the "
    "host name); once joined, the node's certificate names it.",
    "cluster_dir": "The node's lab PKI: CA certificate, node key and certificate, join tokens on the "
    "CA node (default <state_dir>/cluster, root only). Federation runs only once it holds a "
    "certificate (`sing cluster init` or `join`).",
    "peer_address": "Address the peer service (mutual TLS) and, on the CA node, the join service "
    "listen on (default 0.0.0.0).",
    "peer_port": "TCP port of the peer service (default 7070).",
    "join_port": "TCP port of the join service on the CA node (default 7071; server-only TLS, join "
    "tokens required).",
    "peer_advertise": "host:port peers use to reach this node, told in heartbeats (default: the host "
    "name and peer_port).",
    "peers": "Seed peers, each 'node@host:port' (a TOML list, or comma-separated in SING_PEERS); "
    "contacted whatever happens, so the cluster heals after a partition.",
    "submit_anywhere": "Whether `sing submit` lets a job that cannot start here start on a peer with room "
    "by default (default false; --anywhere/--here per job).",
    "heartbeat_seconds": "Seconds between heartbeats to each peer (default 2); a peer turns suspect "
    "after 3 missed and dead after 10.",
    "peer_keepalive_seconds": "gRPC keepalive ping interval on peer connections (default 20; a ping "
    "unanswered for half of it drops the connection).",
    "move_timeout_seconds": "A move not committed in this time is aborted and the job resumed here "
    "(default 600).",
    "move_hold_seconds": "How long a node holds a job arriving for a move (from PREPARE) without its "
    "commit before discarding it; as a source, how long it asks a target to hold at most, and waits "
    "before taking back a job whose move it aborted unanswered (default 900).",
    "move_connect_seconds": "How long a move keeps trying to reach a target that refuses connections "
    "(a daemon restarting) before it gives up and the job runs on here (default 10; 0: no retry).",
    "move_process_base": "While a job being moved still runs, dump its processes in place (a pause like "
    "any checkpoint's) and send those images to the target as a base, so that after the stop its "
    "process images travel as the blocks the base lacks, rebuilt and checked on the target (default "
    "true; off, or whenever the base cannot be made or sent, the images are sent whole after the stop: "
    "fewer bytes on the link and one freeze less, a longer downtime).",
    "move_preload": "As a move's target, read the device state the source pre-copied onto this node's "
    "devices as soon as it has arrived, while the job still runs there, so that the restore after its "
    "stop reads only what changed since (default true; off: the restore reads all of it).",
}

NON_NEGATIVE_SECONDS = (
    "kill_grace_seconds",
    "move_connect_seconds",
    "shutdown_grace_seconds",
    "checkpoint_interval_seconds",
    "elastic_grow_seconds",
)
"""Options in seconds where 0 is allowed (none, or at once)."""

LIVE_OPTIONS = frozenset(
    {
        "log_level",
        "admin_group",
        "premium_group",
        "kill_grace_seconds",
        "shutdown_grace_seconds",
        "checkpoint_interval_seconds",
        "elastic_grow_seconds",
        "splice_verdict_seconds",
        "checkpoint_keep",
        "checkpoint_pre_copy",
        "proxy_pre_copy",
        "metrics",
        "metrics_address",
        "metrics_port",
        "spool",
        "spool_dir",
        "submit_anywhere",
    }
)
"""Options a running daemon takes from its reloaded config file; every other one needs a restart."""

LOG_LEVELS = ("debug", "info", "warning", "error")

ENV_NAMES: dict[str, str] = {
    "socket": "SING_SOCKET",
    "state_dir": "SING_STATE_DIR",
    "devices": "SING_DEVICES",
    "virtual_devices": "SING_VIRTUAL_DEVICES",
    "log_level": "SING_LOG_LEVEL",
    "peers": "SING_PEERS",
}


def _coerce(name: str, value: Any, source: str) -> Any:
    """Turn a raw value from a file, env or flag into the field's type, or raise ConfigError."""
    paths = ("socket", "state_dir", "checkpoint_dir", "spool_dir", "cluster_dir")
    kinds: dict[str, type] = {f.name: type(f.default) for f in fields(Config) if f.name not in paths}
    try:
        if name in paths:
            return Path(str(value)).expanduser().absolute()
        if name == "peers":
            return _seeds(value, source)
        kind = kinds[name]
        if kind is int and isinstance(value, bool):
            raise TypeError
        if kind is bool and not isinstance(value, bool):
            if str(value).lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            value = str(value).lower() in ("true", "1", "yes")
        coerced = kind(value)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{source}: {name} = {value!r} is not a valid value") from error
    if name == "devices" and coerced not in ("auto", "nvml", "virtual"):
        raise ConfigError(f"{source}: devices must be 'auto', 'nvml' or 'virtual', not {coerced!r}")
    if name == "job_network" and coerced not in ("host", "private"):
        raise ConfigError(f"{source}: job_network must be 'host' or 'private', not {coerced!r}")
    if name in ("virtual_devices", "checkpoint_keep", "proxy_threads") and coerced < 1:
        raise ConfigError(f"{source}: {name} must be at least 1")
    if name == "checkpoint_staging" and coerced and not coerced.startswith("/"):
        raise ConfigError(f"{source}: checkpoint_staging must be an absolute path or '', not {coerced!r}")
    if name == "log_level" and coerced not in LOG_LEVELS:
        raise ConfigError(f"{source}: log_level must be one of {', '.join(LOG_LEVELS)}, not {coerced!r}")
    if name in ("metrics_port", "peer_port", "join_port") and not 0 <= coerced <= 65535:
        raise ConfigError(f"{source}: {name} must be between 0 and 65535")
    if (
        name
        in (
            "heartbeat_seconds",
            "peer_keepalive_seconds",
            "move_timeout_seconds",
            "move_hold_seconds",
            "splice_verdict_seconds",
        )
        and not coerced > 0
    ):
        raise ConfigError(f"{source}: {name} must be more than 0")
    if name in ("checkpoint_pre_copy", "proxy_pre_copy") and coerced < 0:
        raise ConfigError(f"{source}: {name} must not be negative")
    if name in NON_NEGATIVE_SECONDS and coerced < 0:
        raise ConfigError(f"{source}: {name} must not be negative")
    return coerced


def _seeds(value: Any, source: str) -> tuple[str, ...]:
    """Seed peers from a TOML list or a comma-separated string, each checked as node@host:port."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(item, str) for item in items):
        raise ConfigError(f"{source}: peers must be a list of 'node@host:port' strings")
    seeds = []
    for item in items:
        if not item.strip():
            continue
        try:
            seeds.append(str(parse_seed(item)))
        except ValueError as error:
            raise ConfigError(f"{source}: {error}") from None
    return tuple(seeds)


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a TOML config file; a missing file is empty, an unreadable one an error."""
    try:
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError:
        return {}
    except PermissionError:
        raise ConfigError(f"cannot read config file {path}: permission denied") from None
    except IsADirectoryError:
        raise ConfigError(f"cannot read config file {path}: it is a directory") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {path} is not valid TOML: {error}") from None
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
    section = data.get("singularityd", data)
    if not isinstance(section, dict):
        raise ConfigError(f"config file {path}: [singularityd] must be a table")
    return section


def config_path(config_file: Path | None, env: Mapping[str, str]) -> Path:
    """The config file read: the one given, else $SING_CONFIG, else the default for this uid."""
    return config_file or Path(env.get("SING_CONFIG") or default_config_file(os.geteuid()))


def load_config(
    config_file: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the configuration: defaults < file < environment < explicit overrides (flags)."""
    env = os.environ if env is None else env
    uid = os.geteuid()
    explicit_file = config_file is not None or "SING_CONFIG" in env
    path = config_path(config_file, env)
    raw = read_config_file(path)
    if explicit_file and not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    known = {f.name for f in fields(Config)}
    values: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in known:
            raise ConfigError(f"config file {path}: unknown option {name!r}")
        values[name] = _coerce(name, value, str(path))
    for name, variable in ENV_NAMES.items():
        if env.get(variable):
            values[name] = _coerce(name, env[variable], f"environment {variable}")
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = _coerce(name, value, f"--{name.replace('_', '-')}")
    socket = values.pop("socket", default_socket(uid))
    state_dir = values.pop("state_dir", SYSTEM_STATE_DIR if uid == 0 else user_state_dir())
    return replace(Config(socket=socket, state_dir=state_dir), **values)


@dataclass(frozen=True)
class ConfigSource:
    """Where a daemon's configuration came from (file, environment, flags), kept to read it again."""

    config_file: Path | None
    env: Mapping[str, str]
    overrides: Mapping[str, Any]

    @property
    def path(self) -> Path:
        """The config file (it may not exist)."""
        return config_path(self.config_file, self.env)

    def load(self) -> Config:
        """The configuration as the file, environment and flags give it now; ConfigError if bad."""
        return load_config(self.config_file, self.env, self.overrides)


@dataclass(frozen=True)
class ConfigChange:
    """What reading the config file again changes: the configuration to run with (the live options
    updated, the others kept), and each changed option's old and new value."""

    config: Config
    applied: dict[str, tuple[Any, Any]]
    need_restart: dict[str, tuple[Any, Any]]

    def describe(self, names: dict[str, tuple[Any, Any]]) -> str:
        """The changes as `name old -> new` separated by semicolons."""
        return "; ".join(f"{name} {old!s} -> {new!s}" for name, (old, new) in names.items())


def reload_config(current: Config, source: ConfigSource) -> ConfigChange:
    """Read the configuration again and sort its changes into live ones and those needing a restart.

    Flags and SING_* variables keep winning over the file, as at start. ConfigError (the running
    configuration stays) when the file cannot be used.
    """
    fresh = source.load()
    applied: dict[str, tuple[Any, Any]] = {}
    need_restart: dict[str, tuple[Any, Any]] = {}
    for option in fields(Config):
        old, new = getattr(current, option.name), getattr(fresh, option.name)
        if old != new:
            changes = applied if option.name in LIVE_OPTIONS else need_restart
            changes[option.name] = (old, new)
    live = replace(current, **{name: new for name, (_, new) in applied.items()})
    return ConfigChange(live, applied, need_restart)
