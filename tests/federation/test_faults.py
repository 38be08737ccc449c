"""Faults at every step of a move between real daemons: a cut link, a killed or a paused daemon.

Three daemons in a lab (lab.py). Each trial submits a fresh job (tests/programs/ticker.py, a hash
chain in memory), starts `sing migrate` to a peer, waits until the source's or the target's stored
hand-off record reaches the chosen step (prepare, stop = the final checkpoint, transfer, restore,
commit), waits a random moment more, and then cuts the source's or the target's link for a while,
SIGKILLs the source or the target daemon (started again after a
while), or SIGSTOPs the source past every deadline of the move. Afterwards the job must run in
exactly one place (the others know it as moved or not at all), and once told to stop its log must
be exactly what an uninterrupted run of the same number of steps prints. A referee thread
(referee.py) scans /proc throughout: no two nodes may ever have a live copy of a trial's job at
once, nor may one node have a live copy while another holds one it may still let run.

CI runs a fixed sample of trials (one per fault kind and a few steps); SING_FAULT_TRIALS=N runs N
random ones (SING_FAULT_SEED picks them) and prints a table of outcomes; they run with the default
`move_process_base` (on: the process images sent as changes against a base), SING_FAULT_PROCESS_BASE=0
runs them with it off (the images sent whole after the stop).
"""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from singularityd import faults
from tests.federation.lab import Lab, Node, joined_lab
from tests.federation.referee import Referee, holding_of, stored
from tests.federation.test_lab import Background, lab_problem
from tests.helpers import wait_until
from tests.proxy.conftest import PYTHON

# One lab serves the whole module: its tests run in one test process.
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.xdist_group("fault-lab")]

NODES = ("node-a", "node-b", "node-c")
TICKER = Path(__file__).resolve().parents[1] / "programs" / "ticker.py"
MOVE_TIMEOUT_S = 12.0
MOVE_HOLD_S = 12.0
STEPS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str | None]] = {
    "prepare": (("out-preparing",), ("in-prepared",), None),
    "stop": (("out-transferring",), (), "RUNNING"),
    "transfer": (("out-transferring",), (), "MIGRATING"),
    "restore": (("out-restoring",), ("in-restoring", "in-restored"), None),
    "commit": (("out-committed",), (), None),
}
"""For each step of the hand-off: the stored phases of the source and of the target that mark it,
and the job's state on the source then ("stop": its final checkpoint is being taken)."""

FAULTS = ("cut-source", "cut-target", "kill-source", "kill-target", "pause-source")
SAMPLE = [
    ("prepare", "kill-target", 0.0),
    ("stop", "cut-source", 0.05),
    ("transfer", "kill-source", 0.0),
    ("restore", "kill-target", 0.0),
    ("restore", "cut-target", 0.0),
    ("commit", "kill-source", 0.0),
    ("restore", "pause-source", 0.0),
]
"""The trials CI runs: (step, fault, extra delay in seconds after the step is seen)."""


def phase(node: Node, job: int) -> str | None:
    """The phase of a node's stored hand-off record of a job."""
    holding = holding_of(node, job)
    return str(holding["phase"]) if holding else None


def job_state(node: Node, job: int) -> str | None:
    """The job's stored state on a node."""
    return stored(node, "SELECT state FROM jobs WHERE id = ?", job)


@dataclass
class Trial:
    """One move with one fault: where, what, when, and what came of it."""

    number: int
    step: str
    fault: str
    delay: float
    source: str
    target: str
    hit: bool = False
    """Whether the chosen phase was seen before the move ended (else the fault came after it)."""
    moved: bool = False
    ended_on: str = ""
    lost: bool = False
    """The job ended FAILED (a failure of the trial)."""
    steps: int = 0
    seconds: float = 0.0
    failure: str = ""
    """What went wrong (a random run goes on after a failed trial and reports them all)."""


@pytest.fixture(scope="module")
def fault_lab() -> Iterator[Lab]:
    """Three joined daemons with short move deadlines (so a paused source outlives them)."""
    why = lab_problem()
    if why:
        pytest.skip(why)
    config: dict[str, Any] = {"move_timeout_seconds": MOVE_TIMEOUT_S, "move_hold_seconds": MOVE_HOLD_S}
    if os.environ.get("SING_FAULT_PROCESS_BASE") == "0":
        config["move_process_base"] = False
    with joined_lab(NODES, f"flt{os.getpid() % 10000}", config) as made:
        yield made


@pytest.fixture(scope="module")
def referee(fault_lab: Lab) -> Iterator[Referee]:
    """One referee for every trial of the module."""
    watching = Referee(fault_lab)
    yield watching
    watching.stop()


def uninterrupted(steps: int) -> str:
    """What the ticker prints when it runs `steps` steps without interruption."""
    done = subprocess.run(
        [PYTHON, str(TICKER), "--steps", str(steps)], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout


def finish_exactly(owner: Node, job: int, until: Path) -> None:
    """Tell the ticker to stop; its log must be what an uninterrupted run of as many steps prints."""
    until.touch()
    waited = owner.sing("wait", str(job), timeout=120)
    assert waited.code == 0, waited
    log = owner.sing("logs", str(job)).out
    assert log == uninterrupted(int(log.rsplit("stopped after ", 1)[1].split()[0]))


def states(lab: Lab, job: int) -> dict[str, str]:
    """The job's state on each node that knows it."""
    found = {}
    for node in lab.nodes.values():
        shown = node.job(job)
        if shown is not None:
            found[node.name] = str(shown["state"])
    return found


def settled(lab: Lab, job: int) -> str | None:
    """The one node the job runs on (or failed on) once the move is over everywhere, else None."""
    seen = states(lab, job)
    running = [name for name, state in seen.items() if state in ("RUNNING", "FAILED")]
    others = {state for name, state in seen.items() if name not in running}
    if len(running) != 1 or not others <= {"MOVED"}:
        return None
    phases = {node.name: phase(node, job) for node in lab.nodes.values()}
    if phases[running[0]] != "owned" or any(
        p not in (None, "handed-off", "discarded") for name, p in phases.items() if name != running[0]
    ):
        return None
    return running[0]


def where_it_stands(lab: Lab, job: int) -> str:
    """Each node's view of a job (state, hand-off phase, last events), for a failure message."""
    lines = []
    for node in lab.nodes.values():
        shown = node.job(job) or {}
        events = [f"{event.get('to_state')}: {event.get('reason')}" for event in shown.get("events", [])[-6:]]
        lines.append(f"{node.name}: state={shown.get('state')} phase={phase(node, job)} last events={events}")
    return "\n".join(lines)


def wait_settled(lab: Lab, job: int, trial: Trial | None = None, timeout: float = 180) -> str:
    """Wait until the move is over everywhere; on timeout say where each node stands."""
    try:
        owner: str = wait_until(lambda: settled(lab, job), timeout=timeout, interval=0.25)
    except AssertionError as error:
        raise AssertionError(f"{trial}: not settled: {error}\n{where_it_stands(lab, job)}") from None
    return owner


def ensure_up(lab: Lab) -> None:
    """Every daemon running and every link up (after a trial's fault)."""
    for node in lab.nodes.values():
        if node.process is None:
            node.start()
        lab.network.restore(node.name)


def inject(lab: Lab, trial: Trial, rng: random.Random) -> None:
    """Carry out the trial's fault (and heal it)."""
    kind, side = trial.fault.split("-")
    node = lab.node(trial.source if side == "source" else trial.target)
    if kind == "cut":
        lab.network.cut(node.name)
        time.sleep(rng.uniform(0.5, 4.0))
        lab.network.restore(node.name)
    elif kind == "kill":
        node.kill(signal.SIGKILL)
        time.sleep(rng.uniform(0.0, 2.0))
        node.start()
    else:
        node.kill(signal.SIGSTOP)
        time.sleep(MOVE_TIMEOUT_S + MOVE_HOLD_S + 2.0)
        node.kill(signal.SIGCONT)


def start_ticker(node: Node, referee: Referee, until: Path) -> int:
    """Submit a ticker that runs until `until` exists; return its id once it has printed."""
    submitted = node.sing("submit", "--", PYTHON, str(TICKER), "--until", str(until), "--sleep", "0.01")
    assert submitted.code == 0, submitted.err
    job = int(submitted.out)
    referee.watch(str(until), job)
    wait_until(lambda: (node.job(job) or {}).get("state") == "RUNNING", timeout=60, interval=0.1)
    wait_until(lambda: node.rank_log(job).exists() and node.rank_log(job).stat().st_size > 0, 60)
    return job


def run_trial(lab: Lab, referee: Referee, trial: Trial, rng: random.Random) -> Trial:
    """Submit a job on the trial's source, move it with the fault, check where and how it ended."""
    started = time.monotonic()
    source, target = lab.node(trial.source), lab.node(trial.target)
    until = lab.paths.root / f"stop-{trial.number}-{rng.random()}"
    job = start_ticker(source, referee, until)
    source_phases, target_phases, source_state = STEPS[trial.step]
    mover = Background(lambda: source.sing("migrate", str(job), "--to", trial.target, timeout=300))

    def over() -> bool:
        """The move ended (or failed) before the chosen step was seen."""
        return mover.done() or phase(target, job) == "owned" or phase(source, job) == "handed-off"

    def reached() -> bool:
        if phase(source, job) in source_phases and source_state in (None, job_state(source, job)):
            return True
        return phase(target, job) in target_phases or over()

    try:
        wait_until(reached, timeout=120, interval=0.002)
    except AssertionError as error:
        raise AssertionError(f"{error}: the move reached no step\n{where_it_stands(lab, job)}") from None
    trial.hit = not over()
    if mover.done() and mover.result().code != 0:
        print(f"trial {trial.number}: the move ended before the step: {mover.result().err.strip()}")
    time.sleep(trial.delay)
    inject(lab, trial, rng)
    result = mover.result()
    trial.moved = result.code == 0
    ensure_up(lab)
    owner_name = wait_settled(lab, job, trial)
    trial.ended_on = owner_name
    owner = lab.node(owner_name)
    referee.watch("", None)
    shown: dict[str, Any] = owner.job(job) or {}
    if shown.get("state") == "FAILED":
        trial.lost = True
        raise AssertionError(f"job lost: {[event['reason'] for event in shown['events']]}")
    until.touch()
    waited = owner.sing("wait", str(job), timeout=120)
    assert waited.code == 0, (trial, waited)
    log = owner.sing("logs", str(job)).out
    trial.steps = int(log.rsplit("stopped after ", 1)[1].split()[0])
    assert log == uninterrupted(trial.steps), trial
    assert not referee.live_copies(str(until)), trial
    trial.seconds = time.monotonic() - started
    return trial


def trials(count: int, seed: int) -> list[Trial]:
    """`count` trials with random steps, faults, delays and nodes."""
    rng = random.Random(seed)
    made = []
    for number in range(count):
        source, target = rng.sample(NODES, 2)
        made.append(
            Trial(number, rng.choice(list(STEPS)), rng.choice(FAULTS), rng.uniform(0.0, 0.3), source, target)
        )
    return made


def summary(done: list[Trial]) -> str:
    """A table of outcomes by step and fault."""
    rows: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0, 0, 0, 0, 0])
    for trial in done:
        row = rows[(trial.step, trial.fault)]
        row[0] += 1
        row[1] += trial.hit
        row[2] += trial.ended_on == trial.target and not trial.lost
        row[3] += trial.ended_on == trial.source and not trial.lost
        row[4] += trial.lost
        row[5] += bool(trial.failure)
    lines = [
        "| step | fault | trials | fault during the step | runs on target | runs on source | lost | failed |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (step, fault), counts in sorted(rows.items()):
        lines.append(f"| {step} | {fault} | " + " | ".join(str(count) for count in counts) + " |")
    return "\n".join(lines)


@pytest.mark.parametrize("point", [faults.STOPPING_DUMP_RUNNING, faults.STOPPING_DUMP_DONE])
def test_source_killed_in_the_final_dump_keeps_the_job(fault_lab: Lab, referee: Referee, point: str) -> None:
    """The source daemon dies at an exact step of the move's final checkpoint (a fault point):
    while CRIU dumps, or once CRIU has dumped and stopped the job but before the checkpoint is
    recorded. CRIU finishes without it; the restarted daemon records that checkpoint, the move is
    abandoned, and the job resumes on the source from it, its output exact."""
    source, target = fault_lab.node("node-a"), fault_lab.node("node-b")
    source.kill(signal.SIGTERM)
    source.start(env={faults.ENV: point})
    until = fault_lab.paths.root / f"stop-{point}"
    job = start_ticker(source, referee, until)
    mover = Background(lambda: source.sing("migrate", str(job), "--to", target.name, timeout=300))
    assert source.process is not None
    assert source.process.wait(120) == -signal.SIGKILL
    source.process = None
    assert mover.result().code != 0
    source.start()
    owner = wait_settled(fault_lab, job)
    referee.watch("", None)
    assert owner == source.name
    shown = source.job(job) or {}
    reasons = [str(event["reason"]) for event in shown["events"]]
    assert shown["state"] == "RUNNING", reasons
    assert any("CRIU finished the dump after the daemon died" in reason for reason in reasons), reasons
    finish_exactly(source, job, until)
    assert referee.violations == []


def test_target_killed_once_the_arrival_is_stored_gives_its_copy_up(fault_lab: Lab, referee: Referee) -> None:
    """The target daemon dies at an exact step of its restore (a fault point): the arriving job's
    record is stored (MIGRATING, devices reserved), nothing of it restored yet. The restarted
    target must give that copy up for good (its record MOVED, not MIGRATING forever), and the job
    resume on the source, once, its output exact."""
    source, target = fault_lab.node("node-c"), fault_lab.node("node-a")
    target.kill(signal.SIGTERM)
    target.start(env={faults.ENV: faults.ARRIVAL_IMPORTED})
    until = fault_lab.paths.root / "stop-arrival-imported"
    try:
        job = start_ticker(source, referee, until)
        mover = Background(lambda: source.sing("migrate", str(job), "--to", target.name, timeout=300))
        assert target.process is not None
        assert target.process.wait(120) == -signal.SIGKILL
        target.process = None
        target.start()
        assert mover.result().code != 0
        assert wait_settled(fault_lab, job) == source.name
        referee.watch("", None)
        shown = target.job(job) or {}
        reasons = [str(event["reason"]) for event in shown.get("events", [])]
        assert shown.get("state") == "MOVED", reasons
        assert any("this daemon restarted before the job was restored" in reason for reason in reasons), (
            reasons
        )
        finish_exactly(source, job, until)
        assert referee.violations == []
    finally:
        if target.process is None:
            target.start()


def spoil_drafts(target: Node, job: int, every: int) -> int:
    """Overwrite every `every`th 4 KiB block of the drafts (copies of the base's pages images) the
    target made for the job's arrival, once they are whole; how many drafts were spoiled."""
    incoming = target.state_dir / "checkpoints" / ".incoming"

    def drafts() -> list[Path]:
        return sorted(incoming.glob(f"{job}@*/draft/pages-*.img"))

    wait_until(lambda: bool(drafts()) and not list(incoming.glob(f"{job}@*/draft/*.partial")), 60, 0.05)
    for draft in drafts():
        with open(draft, "r+b") as handle:
            for block in range(0, draft.stat().st_size // 4096, every):
                handle.seek(block * 4096)
                handle.write(b"\xa5" * 4096)
    return len(drafts())


@pytest.mark.parametrize("every", [8, 1], ids=["some-blocks", "every-block"])
def test_a_spoiled_base_fails_the_move_before_the_copy_runs(
    fault_lab: Lab, referee: Referee, every: int
) -> None:
    """The target's copy of the base goes bad on its disk while the source holds after its final
    dump (a fault point). The target rebuilds the process images over it, restores them frozen
    while it hashes them, finds them unlike the manifest's and kills its copy before it runs: the
    move fails, and the job resumes on the source, once, its output exact. With every block
    spoiled, CRIU's restore itself fails (the vdso's page is among them): the reason given is
    still the images' checksum, not CRIU's symptom."""
    source, target = fault_lab.node("node-a"), fault_lab.node("node-c")
    hold = fault_lab.paths.root / f"hold-spoiled-base-{every}"
    source.kill(signal.SIGTERM)
    source.start(env={faults.ENV: faults.STOPPED_DUMP_RECORDED, faults.HOLD_ENV: str(hold)})
    try:
        until = fault_lab.paths.root / f"stop-spoiled-base-{every}"
        job = start_ticker(source, referee, until)
        mover = Background(lambda: source.sing("migrate", str(job), "--to", target.name, timeout=300))
        wait_until(lambda: Path(f"{hold}.reached").exists(), timeout=120, interval=0.05)
        assert spoil_drafts(target, job, every) >= 1
        hold.touch()
        assert mover.result().code != 0
        assert wait_settled(fault_lab, job) == source.name
        referee.watch("", None)
        reasons = [
            str(event["reason"])
            for node in (source, target)
            for event in (node.job(job) or {}).get("events", [])
        ]
        assert any("pages-" in reason and "fails its sha256 check" in reason for reason in reasons), (
            "\n".join(reasons)
        )
        finish_exactly(source, job, until)
        assert referee.violations == []
    finally:
        hold.touch()
        source.kill(signal.SIGTERM)
        source.start()


def move_until_held(source: Node, target: Node, job: int, reached: Path, attempts: int = 30) -> Background:
    """Start moving the job until the target announces it holds at its fault point. While a target
    just restarted cannot be reached (gRPC UNAVAILABLE: it refuses connections, or the source's
    channel to it still backs off), the source sends PREPARE again for `move_connect_seconds`
    (10 s here); a move that still ends before the target's restore (the target unreachable for
    longer, or its PREPARE refused) is tried again, a second after the job is back at the source."""
    for _ in range(attempts):
        mover = Background(lambda: source.sing("migrate", str(job), "--to", target.name, timeout=300))

        def reached_or_over(moving: Background = mover) -> bool:
            return reached.exists() or moving.done()

        wait_until(reached_or_over, timeout=120, interval=0.02)
        if reached.exists():
            return mover
        print(f"move of {job} to {target.name} ended before the restore: {mover.result().err.strip()}")
        wait_until(lambda: job_state(source, job) == "RUNNING" and phase(source, job) == "owned", 120, 0.1)
        time.sleep(1.0)
    raise AssertionError(f"job {job} never reached the restore on {target.name}")


@pytest.mark.parametrize("heal", ["after-the-hold", "before-the-restore-ends"])
def test_link_cut_while_the_target_restores_keeps_one_copy(
    fault_lab: Lab, referee: Referee, heal: str
) -> None:
    """The target holds at an exact step (a fault point): its copy restored frozen, its hand-off
    record still restoring. The source's link is cut, so RESTORE's answer never comes and the
    source aborts. It must not resume its copy while the target may still let its own run: it
    resumes only once the target confirmed the abort (the link healed before the restore ends: the
    target's discard waits for the restore, kills its copy, then answers), or once the target's
    hold has ended by the source's clock (the link still cut). The referee holds both sides to
    that; the job ends on the source, once, its output exact."""
    source, target = fault_lab.node("node-b"), fault_lab.node("node-c")
    hold = fault_lab.paths.root / f"hold-{heal}"
    target.kill(signal.SIGTERM)
    target.start(env={faults.ENV: faults.RESTORED_FROZEN, faults.HOLD_ENV: str(hold)})
    try:
        until = fault_lab.paths.root / f"stop-restoring-{heal}"
        job = start_ticker(source, referee, until)
        mover = move_until_held(source, target, job, Path(f"{hold}.reached"))
        assert phase(target, job) == "in-restoring"
        frozen = referee.copies(str(until))
        assert set(frozen) == {target.name} and frozen[target.name].dormant and not frozen[target.name].live
        fault_lab.network.cut(source.name)
        wait_until(lambda: (holding_of(source, job) or {}).get("resume_pending"), timeout=120, interval=0.05)
        assert job_state(source, job) == "MIGRATING", "the source resumed while the target held a copy"
        if heal == "before-the-restore-ends":
            fault_lab.network.restore(source.name)
            wait_until(lambda: phase(target, job) == "discarded", timeout=120, interval=0.05)
        hold.touch()
        wait_until(lambda: job_state(source, job) == "RUNNING", timeout=120, interval=0.05)
        fault_lab.network.restore(source.name)
        assert mover.result().code != 0
        assert wait_settled(fault_lab, job) == source.name
        referee.watch("", None)
        reasons = [str(event["reason"]) for event in (source.job(job) or {})["events"]]
        assert any("resuming here" in reason for reason in reasons), reasons
        finish_exactly(source, job, until)
        assert not referee.copies(str(until))
        assert referee.violations == []
    finally:
        hold.touch()
        fault_lab.network.restore(source.name)
        target.kill(signal.SIGTERM)
        target.start()


@pytest.mark.timeout(900 + 120 * int(os.environ.get("SING_FAULT_TRIALS", "0")))
def test_faults_at_each_step_leave_one_exact_copy(fault_lab: Lab, referee: Referee) -> None:
    count = int(os.environ.get("SING_FAULT_TRIALS", "0"))
    rng = random.Random(int(os.environ.get("SING_FAULT_SEED", "7")))
    if count:
        planned = trials(count, rng.randrange(1 << 30))
    else:
        planned = []
        for number, (step, fault, delay) in enumerate(SAMPLE):
            source, target = NODES[number % 3], NODES[(number + 1) % 3]
            planned.append(Trial(number, step, fault, delay, source, target))
    done = []
    started = time.monotonic()
    for trial in planned:
        if not count:
            done.append(run_trial(fault_lab, referee, trial, rng))
            continue
        try:
            done.append(run_trial(fault_lab, referee, trial, rng))
        except AssertionError as error:
            trial.failure = str(error).splitlines()[0][:300]
            done.append(trial)
            ensure_up(fault_lab)
        seen = f"referee: {referee.samples} samples, {len(referee.violations)} violations"
        print(f"trial {trial} {seen}", flush=True)
    print(f"\n{len(done)} trials in {time.monotonic() - started:.0f}s, referee samples {referee.samples}")
    print(summary(done))
    failures = [trial for trial in done if trial.failure]
    print(f"failed trials: {len(failures)}", *failures, sep="\n")
    assert referee.violations == []
    assert not failures
    assert all(trial.ended_on for trial in done)
