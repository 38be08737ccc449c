"""A lab of real daemons on this machine, each as if on a machine of its own.

Each node gets a network namespace on the test network (netns.py) and a mount namespace of its
own, pinned to a file so that a restarted daemon enters the same one as the jobs it left running
(CRIU then finds the jobs' mounts among its own). Inside it, the node's own folder is mounted
at one path common to all nodes (`LabPaths.common`), and the daemon keeps its socket and state
there: like separate machines that all use /var/lib/singularity, every node sees its jobs at the
same path, while the folders stay apart. The tests reach a node's socket and files through the
node's real folder. Job programs and working directories (this checkout) are shared by all nodes,
as a lab shares them over NFS.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.federation.netns import Network
from tests.helpers import SINGULARITYD, Result, run_sing, wait_until

PEER_PORT = 7070
JOIN_PORT = 7071


def run(*argv: str) -> None:
    """Run a command; raise with its stderr when it fails."""
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


@dataclass
class LabPaths:
    """The folders of one lab: each node's own folder, the common mount point, the namespace pins."""

    root: Path

    @property
    def common(self) -> Path:
        """Where each node sees its own folder (empty outside the nodes' mount namespaces)."""
        return self.root / "common"

    @property
    def pins(self) -> Path:
        """Files that keep each node's mount namespace alive."""
        return self.root / "pins"

    def node(self, name: str) -> Path:
        """A node's own folder (its socket, state and log)."""
        return self.root / "nodes" / name


@dataclass
class Node:
    """One daemon of the lab: its names, namespaces, folder and process."""

    name: str
    address: str
    network_namespace: str
    paths: LabPaths
    config: dict[str, Any] = field(default_factory=dict)
    passwd: Path | None = None
    """An account database this node sees instead of /etc/passwd (another machine's users)."""
    process: subprocess.Popen[bytes] | None = None

    @property
    def folder(self) -> Path:
        """The node's own folder, as the tests see it."""
        return self.paths.node(self.name)

    @property
    def socket(self) -> Path:
        """The node's API socket, as the tests reach it."""
        return self.folder / "run" / "sing.sock"

    @property
    def state_dir(self) -> Path:
        """The node's state folder, as the tests see it."""
        return self.folder / "state"

    @property
    def pin(self) -> Path:
        """The file that keeps the node's mount namespace."""
        return self.paths.pins / self.name

    @property
    def network_pin(self) -> Path:
        """The file that keeps the node's network namespace (its jobs' too)."""
        return Path("/run/netns") / self.network_namespace

    @property
    def log(self) -> Path:
        """The daemon's stderr."""
        return self.folder / "daemon.log"

    def make_namespace(self) -> None:
        """Create the node's folder and its pinned mount namespace with the folder at the common path."""
        (self.folder / "run").mkdir(parents=True, exist_ok=True)
        os.chmod(self.folder, 0o755)
        self.pin.touch()
        mounts = f"mount --bind {self.folder} {self.paths.common}"
        if self.passwd is not None:
            mounts += f" && mount --bind {self.passwd} /etc/passwd"
        run("unshare", f"--mount={self.pin}", "--propagation", "private", "sh", "-c", mounts)

    def write_config(self) -> Path:
        """The node's TOML config (as the daemon sees paths: under the common mount)."""
        path = self.folder / "singularityd.toml"
        lines = [f"{key} = {json.dumps(value)}" for key, value in self.config.items()]
        path.write_text("\n".join(lines) + "\n")
        return self.paths.common / "singularityd.toml"

    def start(self, timeout: float = 60.0, env: Mapping[str, str] | None = None) -> None:
        """Start the daemon in the node's namespaces (with `env` added); return once it is ready."""
        notify_path = self.folder / "notify.sock"
        notify_path.unlink(missing_ok=True)
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(notify_path))
        notify.settimeout(timeout)
        common = self.paths.common
        environment = {**os.environ, **(env or {}), "NOTIFY_SOCKET": str(common / "notify.sock")}
        environment.pop("SING_SOCKET", None)
        command = [
            "nsenter", f"--mount={self.pin}", f"--net={self.network_pin}", "--",
            SINGULARITYD, "--config", str(self.write_config()), "--socket", str(common / "run" / "sing.sock"),
            "--state-dir", str(common / "state"), "--devices", "virtual", "--log-level", "debug",
        ]  # fmt: skip
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=log, env=environment)
        try:
            while "READY=1" not in notify.recv(4096).decode():
                pass
        except TimeoutError:
            self.process.kill()
            raise AssertionError(
                f"{self.name} not ready in {timeout}s:\n{self.log.read_text()[-3000:]}"
            ) from None
        finally:
            notify.close()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the daemon (SIGKILL: it dies at once; its jobs keep running)."""
        if self.process is not None:
            self.process.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.process.wait(30)
                self.process = None

    def sing(self, *args: str, timeout: float = 120.0, user: str | None = None) -> Result:
        """Run the real `sing` against this node (as another user when given)."""
        return run_sing(args, socket_path=self.socket, timeout=timeout, user=user)

    def job(self, job_id: int) -> dict[str, Any] | None:
        """`sing show ID -o json` on this node, or None when it does not know the job."""
        result = self.sing("show", str(job_id), "-o", "json")
        if result.code != 0:
            return None
        data: dict[str, Any] = result.json()
        return data

    def holding(self, job_id: int) -> dict[str, Any] | None:
        """The node's stored hand-off record of a job, read from its database (None: none)."""
        database = self.state_dir / "singularity.db"
        with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=5)) as db:
            row = db.execute("SELECT holding FROM holdings WHERE job_id = ?", (str(job_id),)).fetchone()
        return json.loads(row[0]) if row else None

    def rank_log(self, job_id: int, rank: int = 0) -> Path:
        """A rank's log in this node's folder."""
        return self.state_dir / "jobs" / str(job_id) / "logs" / f"rank-{rank}.log"


@dataclass
class Lab:
    """Nodes on a test network, in a lab cluster made with the real `sing cluster` verbs."""

    network: Network
    paths: LabPaths
    nodes: dict[str, Node]

    @classmethod
    @contextlib.contextmanager
    def create(
        cls,
        root: Path,
        network: Network,
        config: dict[str, Any] | None = None,
        passwd: dict[str, Path] | None = None,
        daemons: tuple[str, ...] | None = None,
    ) -> Iterator[Lab]:
        """Start a daemon per node of `network` (or those named in `daemons`); `passwd` gives some
        nodes another account database. Everything is stopped and unmounted afterwards."""
        paths = LabPaths(root)
        paths.common.mkdir(parents=True)
        paths.pins.mkdir()
        run("mount", "--bind", str(paths.pins), str(paths.pins))
        run("mount", "--make-private", str(paths.pins))
        nodes = {}
        names = list(daemons or network.nodes)
        for name in names:
            net_node = network.nodes[name]
            node = Node(name, net_node.address, net_node.namespace, paths, passwd=(passwd or {}).get(name))
            seeds = [
                f"{other}@{network.nodes[other].address}:{PEER_PORT}" for other in names if other != name
            ]
            node.config = {
                "node_name": name, "peer_port": PEER_PORT, "join_port": JOIN_PORT,
                "peer_advertise": f"{net_node.address}:{PEER_PORT}", "peers": seeds,
                "virtual_devices": 2, "metrics": False, "spool": False, "heartbeat_seconds": 0.5,
                "peer_keepalive_seconds": 2.0, **(config or {}),
            }  # fmt: skip
            node.make_namespace()
            nodes[name] = node
        lab = cls(network, paths, nodes)
        try:
            for node in nodes.values():
                node.start()
            yield lab
        finally:
            lab.close()

    def node(self, name: str) -> Node:
        """A node by name."""
        return self.nodes[name]

    def join_all(self) -> None:
        """`sing cluster init` on the first node, `sing cluster join` on the others; wait for all to meet."""
        first, *others = self.nodes.values()
        init = first.sing("cluster", "init", "--cluster", "test-lab")
        assert init.code == 0, init.err
        command = init.out.split("sing cluster join ", 1)[1].split()
        address, token, fingerprint = command[0], command[2], command[4]
        for node in others:
            joined = node.sing("cluster", "join", address, "--token", token, "--ca-hash", fingerprint)
            assert joined.code == 0, joined.err
        self.wait_all_alive()

    def wait_all_alive(self, timeout: float = 60.0) -> None:
        """Wait until every node sees every other as alive."""

        def all_alive() -> bool:
            for node in self.nodes.values():
                result = node.sing("peers", "-o", "json")
                if result.code != 0:
                    return False
                states = {p["node"]: p["state"] for p in result.json()["peers"]}
                if any(states.get(other) != "alive" for other in self.nodes if other != node.name):
                    return False
            return True

        wait_until(all_alive, timeout, interval=0.5)

    def close(self) -> None:
        """Stop the daemons, kill every job and proxy they left, unmount everything."""
        for node in self.nodes.values():
            if node.process is not None and node.process.poll() is None:
                node.process.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    node.process.wait(20)
                if node.process.poll() is None:
                    node.process.kill()
                    node.process.wait(10)
        for node in self.nodes.values():
            kill_jobs_of(node)
        for node in self.nodes.values():
            with contextlib.suppress(RuntimeError):
                run("umount", "--lazy", str(node.pin))
        with contextlib.suppress(RuntimeError):
            run("umount", "--lazy", str(self.paths.pins))


def processes_in_network_namespace(pin: Path) -> list[int]:
    """PIDs of the processes living in the network namespace a pin file holds (a node's daemon,
    its proxies and its jobs, a job in a user namespace with a mount namespace of its own too)."""
    try:
        wanted = os.stat(pin).st_ino
    except OSError:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}/ns/net").st_ino == wanted:
                    found.append(int(entry))
    return found


def kill_jobs_of(node: Node) -> None:
    """Kill everything left in the node's network namespace (jobs, proxy servers, spawner)."""
    for _ in range(3):
        pids = [pid for pid in processes_in_network_namespace(node.network_pin) if pid != os.getpid()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


@contextlib.contextmanager
def joined_lab(
    names: tuple[str, ...],
    network_prefix: str,
    config: dict[str, Any],
    accounts: Callable[[Path], dict[str, Path]] | None = None,
) -> Iterator[Lab]:
    """A lab of daemons named `names` in a fresh folder under /tmp, joined with the real verbs.

    `accounts(folder)` may write other account databases there and name the nodes that see them.
    The folder is deleted afterwards unless SING_KEEP_TEST_DIRS is set.
    """
    root = Path(tempfile.mkdtemp(prefix="sing-lab-", dir="/tmp"))
    os.chmod(root, 0o755)
    network = Network.create(names, prefix=network_prefix)
    try:
        passwd = accounts(root) if accounts is not None else None
        with Lab.create(root / "lab", network, config, passwd=passwd) as made:
            made.join_all()
            yield made
    finally:
        network.close()
        if not os.environ.get("SING_KEEP_TEST_DIRS"):
            shutil.rmtree(root, ignore_errors=True)
