"""Who the peers are and how they are doing: pure bookkeeping, no I/O, every method given the time.

Seeds come from the configuration; other peers are learnt from heartbeats (each exchange carries
the addresses the other side knows). A peer's state comes only from when we last heard from it:
alive, then suspect, then dead. Dead peers are still contacted, slowly, and seeds always are, so
the cluster heals after a partition of any length. Membership is a hint for placement and for
`sing peers`; it never decides who owns a job (see `handoff`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from singularityd.federation.pki import PkiError, check_node_name


class PeerState(enum.StrEnum):
    """How recently a peer was heard from."""

    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"


@dataclass(frozen=True)
class Seed:
    """A peer's node name and where to reach it (`node@host:port` in the configuration)."""

    node: str
    address: str

    def __str__(self) -> str:
        return f"{self.node}@{self.address}"


def parse_seed(text: str) -> Seed:
    """Parse `node@host:port`; ValueError with a one-line reason otherwise."""
    node, at, address = text.strip().partition("@")
    host, colon, port = address.rpartition(":")
    if not at or not colon or not host or not port.isdigit():
        raise ValueError(f"peer {text!r} should look like node-b@10.0.0.2:7070")
    try:
        check_node_name(node)
    except PkiError as e:
        raise ValueError(str(e)) from None
    return Seed(node, address)


@dataclass(frozen=True)
class DeviceInfo:
    """One device of a peer as its heartbeat describes it."""

    index: int
    kind: str
    name: str
    memory_total: int
    free: bool


@dataclass(frozen=True)
class PeerStatus:
    """What a node says about itself in a heartbeat."""

    node: str
    address: str
    version: str
    devices: tuple[DeviceInfo, ...] = ()
    free_devices: int = 0
    draining: bool = False
    running_jobs: int = 0


@dataclass(frozen=True)
class Timing:
    """Heartbeat period and the silences after which a peer turns suspect, then dead."""

    interval_s: float = 2.0
    suspect_after_s: float = 6.0
    dead_after_s: float = 20.0
    dead_retry_s: float = 30.0
    seed_retry_s: float = 10.0
    forget_after_s: float = 7 * 86400.0


@dataclass
class Member:
    """What this daemon knows about one peer."""

    node: str
    address: str
    seed: bool
    first_seen: float
    status: PeerStatus | None = None
    last_contact: float | None = None
    last_attempt: float | None = None
    last_error: str = ""


@dataclass(frozen=True)
class PeerRow:
    """One line of `sing peers`."""

    node: str
    address: str
    state: PeerState
    devices: int
    free: int
    version: str
    last_contact: float | None
    draining: bool
    error: str


@dataclass
class Membership:
    """The peers of one daemon, from seeds and heartbeats."""

    self_node: str
    timing: Timing = field(default_factory=Timing)
    members: dict[str, Member] = field(default_factory=dict)

    @classmethod
    def from_seeds(
        cls, self_node: str, seeds: Sequence[Seed], now: float, timing: Timing | None = None
    ) -> Membership:
        """A membership that starts from the configured seeds (ourselves left out)."""
        membership = cls(self_node, timing or Timing())
        for seed in seeds:
            if seed.node != self_node:
                membership.members[seed.node] = Member(seed.node, seed.address, True, now)
        return membership

    def state(self, node: str, now: float) -> PeerState:
        """ALIVE, SUSPECT or DEAD from the time since we last heard from `node` (never: DEAD)."""
        member = self.members[node]
        if member.last_contact is None:
            return PeerState.DEAD
        silence = now - member.last_contact
        if silence <= self.timing.suspect_after_s:
            return PeerState.ALIVE
        if silence <= self.timing.dead_after_s:
            return PeerState.SUSPECT
        return PeerState.DEAD

    def heard_from(self, status: PeerStatus, now: float) -> None:
        """A heartbeat exchange with `status.node` succeeded (whichever side called)."""
        if status.node == self.self_node:
            return
        member = self.members.get(status.node)
        if member is None:
            member = self.members[status.node] = Member(status.node, status.address, False, now)
        if status.address and not member.seed:
            member.address = status.address
        member.status, member.last_contact, member.last_error = status, now, ""

    def contact_failed(self, node: str, error: str, now: float) -> None:
        """A heartbeat to `node` failed; its state follows from the silence, the error is shown."""
        member = self.members.get(node)
        if member is not None:
            member.last_error = error

    def learn(self, peers: Iterable[Seed], now: float) -> None:
        """Add peers another node told us about (their names are checked by TLS when we call)."""
        for peer in peers:
            if peer.node != self.self_node and peer.node not in self.members:
                self.members[peer.node] = Member(peer.node, peer.address, False, now)

    def known(self) -> list[Seed]:
        """Every peer's name and address, to tell others in heartbeats."""
        return [Seed(m.node, m.address) for m in self.members.values()]

    def due(self, now: float) -> list[Seed]:
        """Peers to contact now, marked as attempted; non-seeds silent too long are forgotten."""
        t = self.timing
        for node, member in list(self.members.items()):
            quiet_since = member.last_contact if member.last_contact is not None else member.first_seen
            if not member.seed and now - quiet_since > t.forget_after_s:
                del self.members[node]
        targets = []
        for member in self.members.values():
            state = self.state(member.node, now)
            if state is not PeerState.DEAD:
                period = t.interval_s
            else:
                period = min(t.seed_retry_s, t.dead_retry_s) if member.seed else t.dead_retry_s
            if member.last_attempt is None or now - member.last_attempt >= period:
                member.last_attempt = now
                targets.append(Seed(member.node, member.address))
        return targets

    def view(self, now: float) -> list[PeerRow]:
        """What `sing peers` shows, by node name."""
        rows = []
        for member in sorted(self.members.values(), key=lambda m: m.node):
            status = member.status
            rows.append(
                PeerRow(
                    node=member.node,
                    address=member.address,
                    state=self.state(member.node, now),
                    devices=len(status.devices) if status else 0,
                    free=status.free_devices if status else 0,
                    version=status.version if status else "",
                    last_contact=member.last_contact,
                    draining=status.draining if status else False,
                    error=member.last_error,
                )
            )
        return rows

    def with_room(self, gpus: int, now: float) -> list[str]:
        """Alive peers, not draining, with at least `gpus` free devices: most free first (a hint)."""
        fits = [
            m
            for m in self.members.values()
            if m.status is not None
            and self.state(m.node, now) is PeerState.ALIVE
            and not m.status.draining
            and m.status.free_devices >= gpus
        ]
        return [
            m.node for m in sorted(fits, key=lambda m: (-(m.status.free_devices if m.status else 0), m.node))
        ]
