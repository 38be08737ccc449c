"""A model of two daemons, the link between them and one job, driven by the pure hand-off machine.

Explicitly a unit-test harness for orchestration logic: the "world" (processes, images, RPCs) is
simulated so that every interleaving of deliveries, replies, local work, crashes, link cuts and
deadline expiries can be enumerated. Each daemon behaves like the real driver will: it stores the
holding `decide` returns, then carries out the actions in order (a crash may cut that list short),
and it handles the next stimulus only once the previous actions were carried out.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from singularityd.federation import handoff as h

JOB = "job-1"
SETTINGS = h.Settings(attempt_timeout_s=100.0, hold_s=150.0)
TIME_JUMP = 1000.0


class Violation(AssertionError):
    """An invariant of the hand-off failed in some reachable state."""


class Node(NamedTuple):
    """One daemon: its durable holding, and what a crash loses (pending actions, local work)."""

    holding: h.Holding | None
    up: bool = True
    todo: tuple[h.Action, ...] = ()
    ops: tuple[tuple[str, int, bool], ...] = ()  # (kind, epoch, effect already applied)
    running: bool = False
    checkpoint: bool = False
    frozen: frozenset[int] = frozenset()
    received: frozenset[int] = frozenset()


class Rpc(NamedTuple):
    """One request from `src` to `dst`; `reply` waits for delivery until `resolved`."""

    src: str
    dst: str
    step: h.Step
    epoch: int
    delivered: bool = False
    reply: h.Reply | None = None
    orphaned: bool = False
    resolved: bool = False


class Budget(NamedTuple):
    """How many faults the adversary may still inject."""

    crashes: int = 0
    cuts: int = 0
    time_jumps: int = 0
    work_failures: int = 0
    refusals: int = 0
    moves: int = 1


class World(NamedTuple):
    """Everything about the two daemons, the job and the link at one instant."""

    nodes: tuple[tuple[str, Node], ...]
    rpcs: tuple[Rpc, ...] = ()
    now: float = 0.0
    budget: Budget = Budget()

    def node(self, name: str) -> Node:
        """The daemon called `name`."""
        return dict(self.nodes)[name]

    def with_node(self, name: str, node: Node) -> World:
        """This world with one daemon replaced."""
        return self._replace(nodes=tuple((n, node if n == name else x) for n, x in self.nodes))

    def other(self, name: str) -> str:
        """The other daemon's name."""
        return next(n for n, _ in self.nodes if n != name)


def start(budget: Budget) -> World:
    """Job running on A (its owner at epoch 1), B knows nothing of it."""
    a = Node(h.initial_holding(JOB), running=True, checkpoint=True)
    return World((("A", a), ("B", Node(None))), budget=budget)


def feed(world: World, name: str, stimulus: h.Stimulus) -> World:
    """Give one stimulus to a daemon: store the holding it decides, queue the actions."""
    node = world.node(name)
    assert node.up and not node.todo
    try:
        decision = h.decide(node.holding, JOB, stimulus, world.now, SETTINGS)
    except h.InvalidRequest:
        return world
    holding = decision.holding if decision.holding is not None else node.holding
    return world.with_node(name, node._replace(holding=holding, todo=decision.actions))


def execute(world: World, name: str) -> World:
    """Carry out the first pending action of a daemon in the world."""
    node = world.node(name)
    action, rest = node.todo[0], node.todo[1:]
    node = node._replace(todo=rest)
    match action:
        case h.Send(step=step, peer=peer, epoch=epoch):
            return world.with_node(name, node)._replace(rpcs=(*world.rpcs, Rpc(name, peer, step, epoch)))
        case h.StopForMove(epoch=epoch):
            node = node._replace(ops=(*node.ops, ("stop", epoch, False)))
        case h.SendCheckpoint(epoch=epoch):
            node = node._replace(ops=(*node.ops, ("transfer", epoch, False)))
        case h.RestoreFrozen(epoch=epoch):
            node = node._replace(ops=(*node.ops, ("restore", epoch, False)))
        case h.ResumeHere():
            if not node.running:
                if not node.checkpoint:
                    raise Violation(f"{name} was told to resume the job but holds no copy of it")
                node = node._replace(running=True)
        case h.DropLocalCopy():
            if node.running:
                raise Violation(f"{name} dropped its copy of a running job")
            node = node._replace(checkpoint=False)
        case h.ReleaseFrozen(epoch=epoch):
            if node.running:
                pass
            elif epoch in node.frozen | node.received or node.checkpoint:
                fresh = node.frozen - {epoch}, node.received - {epoch}
                node = node._replace(running=True, checkpoint=True, frozen=fresh[0], received=fresh[1])
            else:
                raise Violation(f"{name} was told to run epoch {epoch} but holds nothing of it")
        case h.DiscardIncoming(epoch=epoch):
            node = node._replace(frozen=node.frozen - {epoch}, received=node.received - {epoch})
        case h.Reply():
            return _answer(world.with_node(name, node), name, action)
        case h.Note() | h.MoveFinished():
            pass
    return world.with_node(name, node)


def _answer(world: World, name: str, reply: h.Reply) -> World:
    for i, rpc in enumerate(world.rpcs):
        waiting = rpc.dst == name and rpc.delivered and rpc.reply is None and not rpc.orphaned
        if waiting and (rpc.step, rpc.epoch) == (reply.step, reply.epoch):
            rpcs = list(world.rpcs)
            rpcs[i] = rpc._replace(reply=reply)
            return world._replace(rpcs=tuple(rpcs))
    return world


def _request_stimulus(rpc: Rpc, refuse: bool) -> h.Stimulus:
    match rpc.step:
        case h.Step.PREPARE:
            return h.PrepareReceived(rpc.src, rpc.epoch, "cannot see the working directory" if refuse else "")
        case h.Step.RESTORE:
            return h.RestoreReceived(rpc.src, rpc.epoch)
        case h.Step.COMMIT:
            return h.CommitReceived(rpc.src, rpc.epoch)
        case h.Step.ABORT:
            return h.AbortReceived(rpc.src, rpc.epoch)


def _finish_op(world: World, name: str, index: int) -> tuple[World, h.Stimulus]:
    """Apply the effect of a daemon's local work item; return the stimulus that reports it."""
    node = world.node(name)
    kind, epoch, _ = node.ops[index]
    ops = node.ops[:index] + node.ops[index + 1 :]
    if kind == "stop":
        if not node.running and not node.checkpoint:
            return world.with_node(name, node._replace(ops=ops)), h.MoveWorkFailed(epoch, "no job to stop")
        node = node._replace(ops=ops, running=False, checkpoint=True)
        return world.with_node(name, node), h.CheckpointReady(epoch)
    if kind == "transfer":
        peer_name = world.other(name)
        peer = world.node(peer_name)
        refusal = h.transfer_refusal(peer.holding, name, epoch) if peer.up else "peer down"
        if refusal or not node.checkpoint:
            return world.with_node(name, node._replace(ops=ops)), h.MoveWorkFailed(
                epoch, refusal or "no copy"
            )
        world = world.with_node(peer_name, peer._replace(received=peer.received | {epoch}))
        return world.with_node(name, world.node(name)._replace(ops=ops)), h.TransferDone(epoch)
    if epoch not in node.received:
        return world.with_node(name, node._replace(ops=ops)), h.RestoreFinished(epoch, "files missing")
    node = node._replace(ops=ops, frozen=node.frozen | {epoch})
    return world.with_node(name, node), h.RestoreFinished(epoch)


def successors(world: World) -> Iterator[tuple[str, World]]:
    """Every event that can happen next, with the world it leads to."""
    b = world.budget
    for name, node in world.nodes:
        if not node.up:
            recovered = world.with_node(name, node._replace(up=True))
            yield f"recover {name}", feed(recovered, name, h.Recovered())
            continue
        if b.crashes:
            yield f"crash {name}", _crash(world, name)
        if node.todo:
            yield f"execute {name} {type(node.todo[0]).__name__}", execute(world, name)
            continue
        holding = node.holding
        if b.moves and holding is not None and holding.phase is h.Phase.OWNED:
            moved = world._replace(budget=b._replace(moves=b.moves - 1))
            yield f"move {name}", feed(moved, name, h.MoveRequested(world.other(name)))
        for i, (kind, epoch, _) in enumerate(node.ops):
            done, stimulus = _finish_op(world, name, i)
            yield f"finish {kind} {name}", feed(done, name, stimulus)
            if b.work_failures and kind != "restore":
                failed = world._replace(budget=b._replace(work_failures=b.work_failures - 1))
                ops = node.ops[:i] + node.ops[i + 1 :]
                failed = failed.with_node(name, node._replace(ops=ops))
                yield f"fail {kind} {name}", feed(failed, name, h.MoveWorkFailed(epoch, "injected"))
        if holding is not None and _tick_matters(world, name, holding):
            yield f"tick {name}", feed(world, name, h.Tick())
    yield from _network_events(world)
    if b.time_jumps:
        jumped = world._replace(now=world.now + TIME_JUMP, budget=b._replace(time_jumps=b.time_jumps - 1))
        yield "time jump", jumped


def _tick_matters(world: World, name: str, holding: h.Holding) -> bool:
    """Whether a tick would do anything (one request at a time per job, as the driver does)."""
    if any(rpc.src == name and not rpc.resolved for rpc in world.rpcs):
        return False
    return (
        holding.phase is h.Phase.OUT_COMMITTED
        or (holding.phase is h.Phase.OWNED and holding.abort_pending)
        or (holding.phase is h.Phase.OWNED and holding.resume_pending and world.now >= holding.peer_hold_ends)
        or ((holding.phase in h.ABORTABLE or holding.phase in h.INCOMING) and world.now > holding.deadline)
    )


def _network_events(world: World) -> Iterator[tuple[str, World]]:
    b = world.budget
    for i, rpc in enumerate(world.rpcs):
        src, dst = world.node(rpc.src), world.node(rpc.dst)

        def with_rpc(w: World, new: Rpc, i: int = i) -> World:
            rpcs = list(w.rpcs)
            rpcs[i] = new
            return w._replace(rpcs=tuple(rpcs))

        if not rpc.delivered and dst.up and not dst.todo:
            delivered = with_rpc(world, rpc._replace(delivered=True))
            yield f"deliver {rpc.step} to {rpc.dst}", feed(delivered, rpc.dst, _request_stimulus(rpc, False))
            if rpc.step is h.Step.PREPARE and b.refusals:
                refusing = delivered._replace(budget=b._replace(refusals=b.refusals - 1))
                yield (
                    f"deliver {rpc.step} (cannot host)",
                    feed(refusing, rpc.dst, _request_stimulus(rpc, True)),
                )
        if not rpc.delivered and rpc.resolved:
            yield f"drop late {rpc.step}", with_rpc(world, rpc._replace(delivered=True))
        if rpc.resolved or not src.up or src.todo:
            continue
        if rpc.reply is not None:
            r = rpc.reply
            answer = h.StepAnswered(rpc.step, rpc.epoch, r.ok, r.reason, r.discarded, r.recorded_epoch)
            answered = with_rpc(world, rpc._replace(resolved=True))
            yield f"answer {rpc.step} to {rpc.src}", feed(answered, rpc.src, answer)
        failure = h.StepFailed(rpc.step, rpc.epoch, "no answer")
        if rpc.orphaned or (not dst.up and not rpc.delivered):
            # The peer is down or lost the request: the call fails at no cost to the adversary.
            failed = with_rpc(world, rpc._replace(resolved=True, delivered=True))
            yield f"fail {rpc.step} at {rpc.src} (peer down)", feed(failed, rpc.src, failure)
        elif b.cuts:
            cut = world._replace(budget=b._replace(cuts=b.cuts - 1))
            lost = with_rpc(cut, rpc._replace(resolved=True, delivered=True))
            yield f"fail {rpc.step} at {rpc.src} (cut)", feed(lost, rpc.src, failure)
            if not rpc.delivered:
                late = with_rpc(cut, rpc._replace(resolved=True))
                yield (
                    f"fail {rpc.step} at {rpc.src} (cut, request arrives late)",
                    feed(late, rpc.src, failure),
                )


def collect(world: World) -> World:
    """Forget requests that can have no further effect (answered or failed, and delivered or dropped)."""
    live = tuple(rpc for rpc in world.rpcs if not (rpc.resolved and rpc.delivered))
    return world if live == world.rpcs else world._replace(rpcs=live)


def _crash(world: World, name: str) -> World:
    """SIGKILL of a daemon: its pending actions and local work vanish; processes and files stay."""
    node = world.node(name)
    world = world.with_node(name, node._replace(up=False, todo=(), ops=()))
    rpcs = []
    for rpc in world.rpcs:
        if rpc.src == name:
            rpc = rpc._replace(resolved=True)
        if rpc.dst == name and rpc.delivered and rpc.reply is None:
            rpc = rpc._replace(orphaned=True)
        rpcs.append(rpc)
    return world._replace(rpcs=tuple(rpcs), budget=world.budget._replace(crashes=world.budget.crashes - 1))


def check_safety(world: World) -> None:
    """Invariants that hold in every reachable state."""
    nodes = dict(world.nodes)
    running = [n for n, x in nodes.items() if x.running]
    if len(running) > 1:
        raise Violation(f"two live copies: {running}")
    for name, node in nodes.items():
        if node.running and (node.holding is None or not node.holding.owns):
            raise Violation(f"{name} runs the job without owning it ({node.holding})")
        other = world.other(name)
        if node.running and _may_release(world, world.node(other)):
            raise Violation(f"{name} runs the job while {other} holds a copy it may still let run")
    owners = [n for n, x in nodes.items() if x.holding is not None and x.holding.phase is h.Phase.OWNED]
    if len(owners) > 1:
        raise Violation(f"two owners: {owners}")
    if not any(_holds_the_job(x) for x in nodes.values()):
        raise Violation("the job is lost: no daemon runs it or can resume it")


def _may_release(world: World, node: Node) -> bool:
    """Whether a daemon holds a restored copy (or is restoring one) that a commit could still let run:
    an incoming epoch whose hold has not ended."""
    holding = node.holding
    if holding is None or holding.phase not in h.INCOMING or world.now > holding.deadline:
        return False
    restoring = any(kind == "restore" and epoch == holding.epoch for kind, epoch, _ in node.ops)
    return restoring or holding.epoch in node.frozen


def _holds_the_job(node: Node) -> bool:
    holding = node.holding
    if node.running:
        return True
    if holding is None:
        return False
    if holding.owns and node.checkpoint:
        return True
    return holding.phase is h.Phase.OWNED and bool(node.frozen | node.received)


def check_settled(world: World) -> None:
    """What must be true once every fault is over and nothing is left to happen."""
    nodes = dict(world.nodes)
    owners = [n for n, x in nodes.items() if x.holding is not None and x.holding.owns]
    if len(owners) != 1:
        raise Violation(f"settled with owners {owners}")
    (owner,) = owners
    node = nodes[owner]
    assert node.holding is not None
    if node.holding.phase is not h.Phase.OWNED or not node.running or node.holding.abort_pending:
        raise Violation(f"settled with the owner {owner} in {node.holding} (running={node.running})")
    for name, other in nodes.items():
        if name != owner and (other.running or other.frozen or other.received or other.checkpoint):
            raise Violation(f"settled with leftovers on {name}: {other}")


@dataclass
class Exploration:
    """What an exhaustive search saw."""

    states: int = 0
    settled: int = 0
    crash_points: set[tuple[str, str]] = field(default_factory=set)
    cut_points: set[str] = field(default_factory=set)


def explore(budget: Budget, limit: int = 3_000_000) -> Exploration:
    """Visit every world reachable from the start under `budget`; raise Violation on the first bad one.

    When nothing can happen any more, time passes (for free) so deadlines fire; a world where even
    that changes nothing is settled and must satisfy `check_settled`.
    """
    first = start(budget)
    seen: set[World] = set()
    parents: dict[World, tuple[World, str]] = {}
    stack = [first]
    result = Exploration()
    while stack:
        world = stack.pop()
        if world in seen:
            continue
        seen.add(world)
        result.states += 1
        if result.states > limit:
            raise AssertionError(f"more than {limit} states: shrink the budget")
        try:
            check_safety(world)
        except Violation as e:
            raise Violation(f"{e}\n{trace(parents, world)}") from None
        found = False
        for label, nxt in successors(world):
            found = True
            name = label.split()[1] if " " in label else ""
            if label.startswith("crash"):
                holding = world.node(name).holding
                result.crash_points.add((name, str(holding.phase) if holding else "none"))
            if "(cut" in label:
                result.cut_points.add(label.split()[1])
            nxt = collect(nxt)
            if nxt not in seen:
                parents.setdefault(nxt, (world, label))
                stack.append(nxt)
        if found:
            continue
        later = world._replace(now=world.now + TIME_JUMP)
        if any(x.holding is not None and _tick_matters(later, n, x.holding) for n, x in later.nodes):
            parents.setdefault(later, (world, "time passes"))
            stack.append(later)
            continue
        result.settled += 1
        try:
            check_settled(world)
        except Violation as e:
            raise Violation(f"{e}\n{trace(parents, world)}") from None
    return result


def trace(parents: dict[World, tuple[World, str]], world: World) -> str:
    """The events that led from the start to `world`, one a line."""
    labels = []
    while world in parents:
        world, label = parents[world]
        labels.append(label)
    return "\n".join(f"  {i + 1}. {label}" for i, label in enumerate(reversed(labels)))
