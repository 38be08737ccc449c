"""A test network: N network namespaces, each joined by a veth link to a bridge in a hub namespace.

Each node namespace has `eth0` with an address in 10.213.0.0/24, a range used only inside these
namespaces; the host's own interfaces are never touched. A link is cut by taking the hub's end
of the node's veth down: the node's packets are then dropped silently, as when a cable is pulled
(its own interface keeps its address and route), and restored by bringing it up again.
Processes run inside a node with `ip netns exec`. Everything is removed by `close()`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

SUBNET = "10.213.0"


def ip(*args: str) -> None:
    """Run `ip` with the arguments; raise with its stderr when it fails."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def available() -> str:
    """'' when this machine can make the test network, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    return ""


@dataclass
class Node:
    """One namespace: its name and address on the test network."""

    name: str
    namespace: str
    address: str
    uplink: str


@dataclass
class Network:
    """The namespaces, the hub, and the processes started in them."""

    prefix: str
    nodes: dict[str, Node] = field(default_factory=dict)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def hub(self) -> str:
        """The namespace holding the bridge."""
        return f"{self.prefix}-hub"

    @classmethod
    def create(cls, names: Sequence[str], prefix: str | None = None) -> Network:
        """Namespaces for `names` (addresses .1, .2, ... in order), all linked to one bridge."""
        network = cls(prefix or f"fedt{os.getpid()}")
        try:
            ip("netns", "add", network.hub)
            ip("-n", network.hub, "link", "add", "br0", "type", "bridge")
            ip("-n", network.hub, "link", "set", "br0", "up")
            for i, name in enumerate(names, start=1):
                node = Node(name, f"{network.prefix}-{i}", f"{SUBNET}.{i}", f"n{i}")
                ip("netns", "add", node.namespace)
                network.nodes[name] = node
                ip("link", "add", "eth0", "netns", node.namespace, "type", "veth",
                   "peer", "name", node.uplink, "netns", network.hub)  # fmt: skip
                ip("-n", network.hub, "link", "set", node.uplink, "master", "br0")
                ip("-n", network.hub, "link", "set", node.uplink, "up")
                ip("-n", node.namespace, "link", "set", "lo", "up")
                ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", "eth0")
                ip("-n", node.namespace, "link", "set", "eth0", "up")
        except BaseException:
            network.close()
            raise
        return network

    def cut(self, name: str) -> None:
        """Cut the node's link: its traffic is dropped silently until `restore`."""
        ip("-n", self.hub, "link", "set", self.nodes[name].uplink, "down")

    def restore(self, name: str) -> None:
        """Bring the node's link back."""
        ip("-n", self.hub, "link", "set", self.nodes[name].uplink, "up")

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """The argv that runs `argv` inside the node's namespace."""
        return ["ip", "netns", "exec", self.nodes[name].namespace, *argv]

    def start(self, name: str, argv: Sequence[str], **popen: object) -> subprocess.Popen[bytes]:
        """Start a process inside the node's namespace; it is killed by `close()`."""
        process: subprocess.Popen[bytes] = subprocess.Popen(self.command(name, argv), **popen)  # type: ignore[call-overload]
        self.processes.append(process)
        return process

    def close(self) -> None:
        """Kill the processes started here and delete every namespace (the veths go with them)."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        for node in self.nodes.values():
            with contextlib.suppress(RuntimeError):
                ip("netns", "del", node.namespace)
        with contextlib.suppress(RuntimeError):
            ip("netns", "del", self.hub)
