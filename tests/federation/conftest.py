"""Fixtures for the federation tests: a lab CA with certified nodes, and test networks of namespaces."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from singularityd.federation.pki import NodeIdentity, Pki
from tests.federation import netns
from tests.federation.netns import Network

CLUSTER = "test-lab"


@dataclass
class Lab:
    """A CA node and helpers to certify more nodes locally (the join RPC has its own tests)."""

    root: Path
    ca_node: str = "node-a"
    pki: Pki = field(init=False)
    token: str = field(init=False)
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        self.pki = Pki(self.root / self.ca_node)
        result = self.pki.init(CLUSTER, self.ca_node, time.time())
        self.token, self.fingerprint = str(result.token), result.ca_fingerprint

    def node_pki(self, name: str) -> Pki:
        """The PKI directory of node `name` (empty until it is certified)."""
        return Pki(self.root / name)

    def identity(self, name: str, *, at: float | None = None, days: int = 30) -> NodeIdentity:
        """Certify `name` (key made in its own directory), as if it joined at time `at`."""
        if name == self.ca_node:
            return self.pki.identity(time.time())
        pki = self.node_pki(name)
        when = time.time() if at is None else at
        token = self.token if at is None else str(self.pki.create_token(when)[0])
        if at is not None:
            self.pki.forget_node(name)
        cert, ca = self.pki.sign_request(token, pki.join_request(name), when, node_days=days)
        pki.install(cert, ca, self.fingerprint, name)
        return pki.identity(when)


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    """A fresh lab CA on node-a."""
    yield Lab(tmp_path / "lab")


@pytest.fixture
def foreign_lab(tmp_path: Path) -> Iterator[Lab]:
    """Another lab, with its own CA, whose node names collide with the first one's."""
    yield Lab(tmp_path / "foreign")


@pytest.fixture
def network() -> Iterator[Callable[..., Network]]:
    """A factory of test networks (namespaces on a bridge); everything is removed afterwards."""
    why = netns.available()
    if why:
        pytest.skip(why)
    made: list[Network] = []

    def make(*names: str) -> Network:
        net = Network.create(names, prefix=f"fedt{os.getpid()}x{len(made)}")
        made.append(net)
        return net

    yield make
    for net in made:
        net.close()
