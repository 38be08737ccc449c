"""The daemon's federation: its lab identity, peer service, membership, hand-offs and the verbs on them.

`Federation` is built with the daemon and started after it. It runs only once the node holds a
certificate (`init` makes a lab CA here, `join` gets one from the CA node; both take effect at
once, without a restart): then it serves the peer service (mutual TLS) and, on the CA node, the
join service; heartbeats keep the membership; the hand-off driver is recovered at start and
ticked every second. Every refusal is a plain error of singularityd.errors, one line each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Iterable
from typing import Any

import grpc.aio

from singularityd import __version__
from singularityd.config import Config
from singularityd.core.states import JobState
from singularityd.daemon import Daemon
from singularityd.errors import InvalidRequest, StateConflict, Unsatisfiable
from singularityd.federation import handoff as h
from singularityd.federation import jobfiles, tls
from singularityd.federation.arrivals import Arrivals
from singularityd.federation.driver import Handoffs
from singularityd.federation.facts import (
    ClusterJobs,
    JoinInfo,
    MoveFacts,
    MoveReport,
    PeersView,
    listing_fields,
)
from singularityd.federation.heartbeat import Heartbeats
from singularityd.federation.holdings import StoredHoldings
from singularityd.federation.join import JoinError, join, start_join_server
from singularityd.federation.membership import DeviceInfo, Membership, PeerState, PeerStatus, Seed, Timing
from singularityd.federation.moves import DaemonMoves, is_owned_here
from singularityd.federation.peer import PeerChannels, PeerServer, PeerService
from singularityd.federation.pki import (
    JoinToken,
    NodeIdentity,
    Pki,
    PkiError,
    check_node_name,
    is_fingerprint,
    node_of_job,
)
from singularityd.federation.v1 import peer_pb2 as pb
from singularityd.store import JobRecord
from singularityd.tiers import standing
from singularityd.units import human_bytes

log = logging.getLogger(__name__)

TICK_S = 1.0
LIST_TIMEOUT_S = 5.0
MOVE_POLL_S = 0.1
PLACE_RETRY_S = 2.0
"""How often a job submitted with --anywhere that waits here looks for a peer with room."""
PLACE_REFUSED_S = 30.0
"""How long such a job leaves alone a peer that refused it."""


def peer_job(job: JobRecord) -> pb.PeerJob:
    """A job as this node describes it to peers (no environment)."""
    message = pb.PeerJob(**listing_fields(job))
    if job.exit_code is not None:
        message.exit_code = job.exit_code
    if job.signal is not None:
        message.signal = job.signal
    return message


class Federation:
    """This daemon in a lab cluster (idle until the node holds a certificate)."""

    def __init__(self, daemon: Daemon, config: Config) -> None:
        self.daemon = daemon
        self.config = config
        self.pki = Pki(config.cluster_folder)
        self.identity: NodeIdentity | None = None
        self.membership: Membership | None = None
        self.handoffs: Handoffs | None = None
        self.moves: DaemonMoves | None = None
        self._channels: PeerChannels | None = None
        self._server: PeerServer | None = None
        self._join_server: grpc.aio.Server | None = None
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._lock = asyncio.Lock()
        self.draining = daemon.store.setting("draining") == "1"
        daemon.holding_queue = self._queue_hold()

    # Start and stop

    @property
    def active(self) -> bool:
        """Whether this node is in a lab cluster (it holds a certificate)."""
        return self.identity is not None

    async def start(self) -> None:
        """Join the cluster this node's certificate names, if it has one."""
        try:
            identity = await asyncio.to_thread(self.pki.identity, time.time())
        except PkiError as error:
            log.info("not in a lab cluster (%s)", error)
            return
        try:
            await self._activate(identity)
        except OSError as error:
            log.error("federation off: %s", error)
            await self.stop()
            self.identity = None

    async def _activate(self, identity: NodeIdentity) -> None:
        """Serve peers, heartbeat, and settle the hand-offs the records left unfinished."""
        config, daemon = self.config, self.daemon
        self.identity = identity
        daemon.store.node_number = identity.number
        keepalive = tls.Keepalive(config.peer_keepalive_seconds, config.peer_keepalive_seconds / 2)
        channels = PeerChannels(identity, keepalive)
        beat = config.heartbeat_seconds
        timing = Timing(beat, 3 * beat, 10 * beat, 5 * beat, 5 * beat)
        membership = Membership.from_seeds(identity.node_name, self._seeds(), time.time(), timing)
        holdings = StoredHoldings(daemon.store)
        arrivals = Arrivals(daemon, holdings, draining=lambda: self.draining)
        moves = DaemonMoves(daemon, holdings, channels, self.address_of, arrivals)
        settings = h.Settings(config.move_timeout_seconds, config.move_hold_seconds)
        handoffs = Handoffs(
            holdings,
            moves,
            channels,
            self.address_of,
            settings=settings,
            connect_retry_s=config.move_connect_seconds,
        )
        heartbeats = Heartbeats(membership, channels, self.local_status)
        service = PeerService(
            heartbeats=heartbeats, handoffs=handoffs, transfers=arrivals.receivers, jobs=self
        )
        bind = f"{config.peer_address}:{config.peer_port}"
        server = PeerServer(identity, bind, service, keepalive=keepalive)
        await server.start()
        self._channels, self._server, self.membership = channels, server, membership
        self.handoffs, self.moves = handoffs, moves
        if self.pki.is_ca:
            join_bind = f"{config.peer_address}:{config.join_port}"
            self._join_server, _ = await start_join_server(
                self.pki, identity, join_bind, config.advertised_address
            )
        log.info("in the lab as %s (node number %d)", identity.node_name, identity.number)
        await asyncio.to_thread(self._remove_leftovers, holdings)
        await handoffs.recover()
        self._stop.clear()
        self._spawn(heartbeats.run(self._stop))
        self._spawn(self._tick())

    def _remove_leftovers(self, holdings: StoredHoldings) -> None:
        """Delete the staged and received folders of moves that ended with the daemon's last run."""

        def arriving(job_id: str, epoch: int) -> bool:
            holding = holdings.load(job_id)
            return holding is not None and holding.epoch == epoch and holding.phase in h.INCOMING

        for folder, size in jobfiles.remove_leftovers(self.config.checkpoints, arriving):
            log.info("deleted %s (%s), left by a move cut short", folder, human_bytes(size))

    def _seeds(self) -> list[Seed]:
        """The configured peers, and those learnt when joining."""
        seeds = [Seed(*text.split("@", 1)) for text in self.config.peers]
        known = {seed.node for seed in seeds}
        remembered = self.pki.remembered_peers()
        return seeds + [Seed(node, address) for node, address in remembered.items() if node not in known]

    async def _tick(self) -> None:
        """Fire the hand-offs' deadlines and resends every second."""
        assert self.handoffs is not None
        while not self._stop.is_set():
            try:
                await self.handoffs.tick()
            except Exception:
                log.exception("hand-off tick failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), TICK_S)

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def stop(self) -> None:
        """Stop serving peers; moves in flight are settled by `recover` at the next start."""
        self._stop.set()
        if self.handoffs is not None:
            await self.handoffs.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._join_server is not None:
            await self._join_server.stop(0.5)
        if self._server is not None:
            await self._server.stop(0.5)
        if self._channels is not None:
            await self._channels.close()

    # What this node tells its peers

    def local_status(self) -> PeerStatus:
        """This node's devices, free capacity, version and draining, for heartbeats."""
        assert self.identity is not None
        daemon = self.daemon
        busy = {*daemon.store.busy_devices(), *daemon.reserved_devices()}
        devices = tuple(
            DeviceInfo(d.index, d.kind, d.name, d.memory_total, d.index not in busy)
            for d in daemon.inventory.devices
        )
        running = len(daemon.store.list_jobs(states=(JobState.RUNNING,)))
        return PeerStatus(
            self.identity.node_name,
            self.config.advertised_address,
            __version__,
            devices,
            sum(d.free for d in devices),
            self.draining,
            running,
        )

    def address_of(self, node: str) -> str:
        """Where a peer listens (KeyError for a node this one does not know)."""
        if self.membership is None:
            raise KeyError(node)
        return self.membership.members[node].address

    def owns(self, job: JobRecord) -> bool:
        """Whether this node owns the job (listings show a job on its owner only)."""
        holdings = self.moves.holdings if self.moves is not None else None
        holding = holdings.load(str(job.id)) if holdings is not None else None
        return is_owned_here(holding, job.state)

    async def list_jobs(self, node: str, request: pb.ListPeerJobsRequest) -> pb.ListPeerJobsReply:
        """A peer's `sing ps --cluster`: the jobs this node owns."""
        jobs = self.daemon.store.list_jobs(include_finished=request.all)
        return pb.ListPeerJobsReply(jobs=[peer_job(job) for job in jobs if self.owns(job)])

    # Joining a lab

    def _require_active(self) -> tuple[NodeIdentity, Membership, Handoffs, DaemonMoves]:
        if self.identity is None or self.membership is None or self.handoffs is None or self.moves is None:
            raise Unsatisfiable(
                "this node is in no lab cluster: run `sing cluster init` or `sing cluster join`"
            )
        return self.identity, self.membership, self.handoffs, self.moves

    def _join_info(self, identity: NodeIdentity, token: str, expires: float) -> JoinInfo:
        host = self.config.advertised_address.rpartition(":")[0]
        return JoinInfo(
            identity.node_name,
            identity.number,
            token,
            self.pki.ca_fingerprint(),
            f"{host}:{self.config.join_port}",
            expires,
        )

    def _new_name(self, node_name: str) -> str:
        """The name this node takes in a lab it makes or joins (refused when it is in one)."""
        if self.identity is not None:
            raise StateConflict(f"this node is already in a lab, as {self.identity.node_name}")
        name = node_name or self.config.host_name
        try:
            return check_node_name(name)
        except PkiError as error:
            raise InvalidRequest(str(error)) from None

    async def init(self, node_name: str, cluster_name: str) -> JoinInfo:
        """Make a lab CA here, certify this node (number 1) and start serving peers."""
        async with self._lock:
            name = self._new_name(node_name)
            try:
                result = await asyncio.to_thread(self.pki.init, cluster_name or "lab", name, time.time())
                identity = await asyncio.to_thread(self.pki.identity, time.time())
            except PkiError as error:
                raise InvalidRequest(str(error)) from None
            await self._activate(identity)
            return self._join_info(identity, str(result.token), result.token_expires_at)

    async def new_token(self) -> JoinInfo:
        """A fresh join token (only on the node that made the lab CA)."""
        identity, _, _, _ = self._require_active()
        try:
            token, expires = await asyncio.to_thread(self.pki.create_token, time.time())
        except PkiError as error:
            raise StateConflict(str(error)) from None
        return self._join_info(identity, str(token), expires)

    async def join(self, address: str, token: str, fingerprint: str, node_name: str) -> tuple[str, int, str]:
        """Get this node certified by the CA node at `address`, then serve peers; (name, number, CA node)."""
        try:
            JoinToken.parse(token)
        except PkiError as error:
            raise InvalidRequest(f"--token: {error}") from None
        if not is_fingerprint(fingerprint):
            raise InvalidRequest("--ca-hash: a CA fingerprint looks like sha256:<64 hex digits>")
        async with self._lock:
            name = self._new_name(node_name)
            try:
                identity = await join(self.pki, name, address, token, fingerprint)
            except (JoinError, PkiError) as error:
                raise StateConflict(str(error)) from None
            await self._activate(identity)
            seeds = self.pki.remembered_peers()
            return identity.node_name, identity.number, ", ".join(sorted(seeds))

    # Verbs

    def peers(self) -> PeersView:
        """This node's name and number and its peers as `sing peers` shows them."""
        if self.identity is None or self.membership is None:
            return PeersView("", 0, self.draining, [])
        rows = self.membership.view(time.time())
        return PeersView(self.identity.node_name, self.identity.number, self.draining, rows)

    def move_facts(self, job_id: int) -> MoveFacts | None:
        """The move of a job away from here under way, if any."""
        return self.moves.facts(job_id) if self.moves is not None else None

    def check_move(self, job: JobRecord, peer: str, *, running: bool) -> None:
        """Refuse, with the reason, a move this node cannot even start."""
        identity, membership, _, _ = self._require_active()
        if peer == identity.node_name:
            raise InvalidRequest(f"job {job.id} is already on {peer}")
        if not peer:
            raise InvalidRequest("a move needs the name of a peer (sing peers lists them)")
        if peer not in membership.members:
            raise InvalidRequest(f"no peer named {peer} (sing peers lists them)")
        if membership.state(peer, time.time()) is PeerState.DEAD:
            error = membership.members[peer].last_error
            raise StateConflict(f"peer {peer} is down" + (f": {error}" if error else ""))
        if not self.owns(job):
            raise StateConflict(f"job {job.id} is not on this node ({job.state})")
        if running and job.state is not JobState.RUNNING:
            raise StateConflict(f"job {job.id} is {job.state}; only a RUNNING job can be migrated")
        if node_of_job(job.id) == 0:
            raise StateConflict(
                f"job {job.id} was submitted before this node joined the lab: its id is not unique "
                "in the lab, so it cannot move"
            )

    async def _move(self, job_id: int, peer: str) -> AsyncIterator[MoveReport]:
        """Run one move (as a task of its own) and report its progress until it ends."""
        _, _, handoffs, moves = self._require_active()
        key = str(job_id)
        if moves.holdings.load(key) is None:
            moves.holdings.save(h.initial_holding(key))
        try:
            finished = self._spawn(handoffs.move(key, peer))
            await asyncio.sleep(0)
        except h.InvalidRequest as error:
            raise StateConflict(str(error)) from None
        last: MoveReport | None = None
        while not finished.done():
            facts = moves.facts(job_id)
            if facts is not None:
                report = MoveReport(job_id, peer, facts.phase, facts.moved, facts.total)
                if report != last:
                    last = report
                    yield report
            await asyncio.wait([finished], timeout=MOVE_POLL_S)
        try:
            outcome: h.MoveFinished = finished.result()
        except h.InvalidRequest as error:
            raise StateConflict(str(error)) from None
        total = last.total if last is not None else 0
        yield MoveReport(job_id, peer, "done", total, total, True, outcome.ok, outcome.detail)

    async def migrate(self, job: JobRecord, peer: str) -> AsyncIterator[MoveReport]:
        """Move a running job to `peer`; its progress, then how it ended."""
        self.check_move(job, peer, running=True)
        async for report in self._move(job.id, peer):
            yield report

    def _queue_hold(self) -> str:
        return "this node is draining (sing undrain takes jobs again)" if self.draining else ""

    def _set_draining(self, draining: bool) -> None:
        self.draining = draining
        self.daemon.store.set_setting("draining", "1" if draining else None)
        self.daemon.holding_queue = self._queue_hold()
        self.daemon.request_schedule()

    async def drain(self) -> AsyncIterator[MoveReport]:
        """Take no new jobs and move every job owned here to a peer with room."""
        _, membership, _, _ = self._require_active()
        self._set_draining(True)
        jobs = drain_order(job for job in self.daemon.store.list_jobs() if self.owns(job))
        for job in jobs:
            current = self.daemon.store.get(job.id)
            if current is None or not current.state.is_listed or not self.owns(current):
                continue
            if node_of_job(job.id) == 0:
                yield MoveReport(job.id, "", "done", done=True, detail="submitted before the lab; it stays")
                continue
            candidates = membership.with_room(job.spec.gpus, time.time())
            if not candidates:
                yield MoveReport(job.id, "", "done", done=True, detail="no peer has room for it; it stays")
                continue
            failed: MoveReport | None = None
            for peer in candidates:
                async for report in self._move(job.id, peer):
                    if not report.done:
                        yield report
                    elif report.ok:
                        yield report
                        failed = None
                        break
                    else:
                        failed = report
                else:
                    continue
                break
            if failed is not None:
                yield failed

    def undrain(self) -> None:
        """Take jobs again (outside a lab, only a node drained while in one has anything to undo)."""
        if not self.draining:
            self._require_active()
        self._set_draining(False)

    def place_elsewhere(self, job_id: int) -> None:
        """A job submitted with --anywhere: while it waits here, move it to a peer with room (one
        may have room only later: it is looked for again every PLACE_RETRY_S)."""
        if self.active:
            self._spawn(self._place(job_id))

    async def _place(self, job_id: int) -> None:
        _, membership, _, moves = self._require_active()
        await asyncio.sleep(0)  # the scheduling round asked for at submission runs first
        refused: dict[str, float] = {}
        while node_of_job(job_id) != 0 and not self._stop.is_set():
            job = self.daemon.store.get(job_id)
            if job is None or job.state is not JobState.PENDING:
                return
            moves.placing.add(job_id)
            try:
                for peer in membership.with_room(job.spec.gpus, time.time()):
                    if peer in refused and time.monotonic() - refused[peer] < PLACE_REFUSED_S:
                        continue
                    final = None
                    async for report in self._move(job_id, peer):
                        final = report
                    if final is not None and final.ok:
                        return
                    refused[peer] = time.monotonic()
            finally:
                moves.placing.discard(job_id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), PLACE_RETRY_S)

    async def cluster_jobs(self, include_finished: bool) -> ClusterJobs:
        """The jobs of this node and of every peer that answers."""
        local = [
            job for job in self.daemon.store.list_jobs(include_finished=include_finished) if self.owns(job)
        ]
        if self.membership is None or self._channels is None:
            return ClusterJobs(local, [], [])
        now = time.time()
        peers = [row.node for row in self.membership.view(now) if row.state is not PeerState.DEAD]
        request = pb.ListPeerJobsRequest(all=include_finished)
        channels = self._channels

        async def ask(node: str) -> pb.ListPeerJobsReply:
            stub = channels.stub(node, self.address_of(node))
            reply: pb.ListPeerJobsReply = await stub.ListJobs(request, timeout=LIST_TIMEOUT_S)
            return reply

        answers = await asyncio.gather(*(ask(node) for node in peers), return_exceptions=True)
        remote: list[tuple[str, pb.PeerJob]] = []
        unreachable = [row.node for row in self.membership.view(now) if row.state is PeerState.DEAD]
        for node, answer in zip(peers, answers, strict=True):
            if isinstance(answer, BaseException):
                unreachable.append(node)
            else:
                remote += [(node, job) for job in answer.jobs]
        return ClusterJobs(local, remote, sorted(unreachable))


def drain_order(jobs: Iterable[JobRecord]) -> list[JobRecord]:
    """The order a drain moves jobs in, while the peers have the most room: running jobs first,
    then queued ones, each by standing (tier, then priority), highest first."""

    def key(job: JobRecord) -> tuple[bool, int, int, int]:
        tier, priority = standing(job.spec.tier, job.spec.priority)
        return job.state is not JobState.RUNNING, -tier, -priority, job.id

    return sorted(jobs, key=key)
