"""The peer service across network namespaces: mTLS handshakes, refusals, keepalive, transfer over a cut.

Each node is a real process (tests/federation/peer_node.py) in a namespace of its own; traffic
goes only over the test network's veth links and bridge (10.213.0.0/24 inside the namespaces).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from singularityd.federation.pki import NodeIdentity
from singularityd.federation.transfer import MiB
from tests.federation.conftest import Lab
from tests.federation.netns import Network
from tests.federation.test_transfer import make_checkpoint, same_tree
from tests.helpers import REPO

PORT = 7070
DAY = 86400.0

pytestmark = pytest.mark.root


@dataclass
class PeerProcess:
    """A peer_node process: send it commands, read its events (with timeouts), keep its stderr."""

    process: subprocess.Popen[bytes]
    stderr_path: Path
    events: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.events.put(json.loads(line))

    def command(self, **command: Any) -> None:
        """Send one command line."""
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(command) + "\n").encode())
        self.process.stdin.flush()

    def expect(
        self, event: str, timeout: float = 30.0, skip: Callable[[dict[str, Any]], None] | None = None
    ) -> dict[str, Any]:
        """The next event named `event` (others go to `skip`); fail the test after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (self.process.poll() is not None and self.events.empty()):
                raise AssertionError(
                    f"no {event!r} event within {timeout}s; stderr:\n{self.stderr()[-3000:]}"
                )
            try:
                got = self.events.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if got["event"] == event:
                return got
            if skip is not None:
                skip(got)

    def stderr(self) -> str:
        """What the process wrote on stderr so far."""
        return self.stderr_path.read_text(errors="replace")


@dataclass
class Cluster:
    """Peer processes in the namespaces of one test network."""

    net: Network
    tmp: Path
    peers: dict[str, PeerProcess] = field(default_factory=dict)

    def address(self, name: str) -> str:
        """host:port of the peer server in namespace `name`."""
        return f"{self.net.nodes[name].address}:{PORT}"

    def start(self, name: str, pki: Path, *extra: str) -> PeerProcess:
        """Start peer_node in namespace `name` with the PKI directory `pki`; wait until it listens."""
        stderr_path = self.tmp / f"{name}.stderr"
        argv = [
            sys.executable,
            "-m",
            "tests.federation.peer_node",
            "--pki",
            str(pki),
            "--listen",
            self.address(name),
        ]
        with open(stderr_path, "wb") as stderr:
            process = self.net.start(
                name,
                [*argv, *extra],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                cwd=REPO,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        peer = PeerProcess(process, stderr_path)
        peer.expect("ready")
        self.peers[name] = peer
        return peer


@pytest.fixture
def cluster(network: Callable[..., Network], tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """A factory: namespaces with the given names, ready for peer processes."""

    def make(*names: str) -> Cluster:
        return Cluster(network(*names), tmp_path)

    yield make


def test_peers_in_separate_namespaces_authenticate_each_other(
    lab: Lab, cluster: Callable[..., Cluster]
) -> None:
    lab.identity("node-b")
    c = cluster("a", "b")
    c.start("b", lab.root / "node-b")
    a = c.start("a", lab.root / "node-a")
    a.command(op="heartbeat", node="node-b", address=c.address("b"))
    assert a.expect("heartbeat") == {"event": "heartbeat", "ok": True, "error": ""}


def bad_client(lab: Lab, identity: NodeIdentity, where: Path) -> Path:
    """A PKI directory holding `identity`'s key and certificate but trusting `lab`'s CA."""
    where.mkdir(parents=True)
    (where / "node.key").write_bytes(identity.key_pem)
    (where / "node.crt").write_bytes(identity.cert_pem)
    (where / "ca.crt").write_bytes(lab.pki.ca_cert_path.read_bytes())
    return where


def test_foreign_ca_expired_and_misnamed_peers_are_refused_and_logged(
    lab: Lab, foreign_lab: Lab, cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    lab.identity("node-b")
    foreign = bad_client(lab, foreign_lab.identity("node-c"), tmp_path / "foreign-client")
    expired = bad_client(
        lab, lab.identity("node-e", at=time.time() - 3 * DAY, days=1), tmp_path / "expired-client"
    )
    c = cluster("b", "c", "e", "a", "d")
    b = c.start("b", lab.root / "node-b")
    # node-c presents a certificate from another lab's CA, node-e an expired one; both trust our
    # CA, so the refusal is the server's.
    for name, pki in (("c", foreign), ("e", expired)):
        peer = c.start(name, pki, "--unchecked")
        peer.command(op="heartbeat", node="node-b", address=c.address("b"))
        refused = peer.expect("heartbeat")
        assert not refused["ok"] and "UNAVAILABLE" in refused["error"], refused
    server_log = b.stderr()
    assert "Handshake failed" in server_log and "certificate has expired" in server_log
    assert "unable to get local issuer certificate" in server_log
    # A client that expects another node than the one answering refuses it, and says so.
    a = c.start("a", lab.root / "node-a")
    a.command(op="heartbeat", node="node-x", address=c.address("b"))
    misnamed = a.expect("heartbeat")
    assert not misnamed["ok"] and "does not name node-x" in misnamed["error"]
    assert "does not name node-x" in a.stderr()
    # A server with a foreign certificate is refused by our client.
    c.start("d", bad_client(lab, foreign_lab.identity("node-d"), tmp_path / "foreign-server"), "--unchecked")
    a.command(op="heartbeat", node="node-d", address=c.address("d"))
    assert "unable to get local issuer certificate" in a.expect("heartbeat")["error"]


def test_keepalive_notices_a_cut_link_on_an_idle_stream(lab: Lab, cluster: Callable[..., Cluster]) -> None:
    """With pings every second, an idle stream over a cut link fails within seconds; without, it hangs."""
    lab.identity("node-b")
    c = cluster("a", "b")
    c.start("b", lab.root / "node-b", "--keepalive-time", "1", "--keepalive-timeout", "1")
    a = c.start("a", lab.root / "node-a", "--keepalive-time", "1", "--keepalive-timeout", "1")
    a.command(op="watch", node="node-b", address=c.address("b"))
    a.expect("watching")
    c.net.cut("a")
    cut_at = time.monotonic()
    ended = a.expect("watch-ended", timeout=30)
    assert "UNAVAILABLE" in ended["error"]
    assert time.monotonic() - cut_at < 15
    c.net.restore("a")

    # Control: a client that does not ping (keepalive far away) keeps the dead stream for as long.
    quiet = cluster("q", "r")
    quiet.start("r", lab.root / "node-b", "--keepalive-time", "3600")
    q = quiet.start("q", lab.root / "node-a", "--keepalive-time", "3600")
    q.command(op="watch", node="node-b", address=quiet.address("r"))
    q.expect("watching")
    quiet.net.cut("q")
    try:
        ended = q.expect("watch-ended", timeout=8)
    except AssertionError as e:
        assert "no 'watch-ended' event" in str(e)
    else:
        pytest.fail(f"without pings the stream over the cut link ended: {ended}\n{q.stderr()[-3000:]}")


def test_a_transfer_resumes_across_a_cut_link_without_resending(
    lab: Lab, cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    lab.identity("node-b")
    src = make_checkpoint(tmp_path / "src", {"images/pages-1.img": 48 * MiB, "proxy/dev-0.state": 8 * MiB})
    incoming = tmp_path / "incoming"
    c = cluster("a", "b")
    c.start("b", lab.root / "node-b", "--receive-into", str(incoming))
    a = c.start("a", lab.root / "node-a")
    a.command(
        op="send", node="node-b", address=c.address("b"), dir=str(src), job="job-9", epoch=4, pause_s=0.5
    )
    reports: list[dict[str, Any]] = []
    cut_once = threading.Event()

    def on_progress(event: dict[str, Any]) -> None:
        reports.append(event)
        if event["phase"] == "sending" and event["moved"] > 16 * MiB and not cut_once.is_set():
            cut_once.set()
            c.net.cut("a")
            threading.Timer(3.0, c.net.restore, args=("a",)).start()

    result = a.expect("sent", timeout=180, skip=on_progress)
    assert result["ok"], result
    assert cut_once.is_set()
    same_tree(src, incoming / "job-9@4")
    comparing = [i for i, r in enumerate(reports) if r["phase"] == "comparing"]
    assert len(comparing) >= 2  # at least one resume after the cut
    last = comparing[-1]
    sent_before, held_at_resume = reports[last]["sent"], reports[last + 1]["moved"]
    assert held_at_resume >= 8 * MiB  # the receiver kept what had arrived
    assert result["sent"] - sent_before == result["total"] - held_at_resume  # and none of it was resent


def test_membership_heals_after_a_partition_longer_than_the_dead_timeout(
    lab: Lab, cluster: Callable[..., Cluster]
) -> None:
    lab.identity("node-b")
    c = cluster("a", "b")
    c.start("b", lab.root / "node-b")
    a = c.start("a", lab.root / "node-a", "--seed", f"node-b@{c.address('b')}", "--heartbeat-interval", "0.3")

    def state_of_b() -> str:
        a.command(op="peers")
        return str(a.expect("peers")["peers"]["node-b"]["state"])

    def wait_for(state: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while state_of_b() != state:
            assert time.monotonic() < deadline, f"node-b never became {state}"
            time.sleep(0.2)

    wait_for("alive", 30)
    c.net.cut("a")
    wait_for("dead", 30)
    time.sleep(3)  # dead for a good while: several seed retries fail
    c.net.restore("a")
    wait_for("alive", 60)
