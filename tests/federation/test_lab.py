"""Three real daemons in a lab cluster, each in network and mount namespaces of its own (lab.py).

Jobs move between them with the real verbs (`sing migrate`, `sing drain`, `sing submit
--anywhere`) and finish byte-identical to an uninterrupted run; bad moves are refused with one
line and a non-zero exit, and nothing is lost.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import DataTable

from singularity.cli.source import DaemonSource
from singularity.cli.top import view
from singularity.cli.top.app import TopApp
from singularity.cli.top.screens import ChoiceScreen
from singularityd.checkpoint import CheckpointUnavailable, locate_criu
from singularityd.federation.pki import Pki
from tests.federation import netns
from tests.federation.lab import Lab, Node, joined_lab
from tests.helpers import OWNER, ensure_user, wait_until
from tests.proxy.conftest import PYTHON
from tests.test_collectives import printed, rank_logs
from tests.test_daemon_proxy import JOB_OPTIONS, direct_output
from tests.test_preempt import DDP_SCRIPT, JOB_ENV, direct_ddp_outputs, without_name_lookup_warnings

# One lab serves the whole module: its tests run in one test process.
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.xdist_group("lab")]

NODES = ("node-a", "node-b", "node-c")
STEPS = 300
OTHER_UID = 4242


def lab_problem() -> str:
    """'' where this machine can run a lab of daemons, else why not."""
    why = netns.available()
    if why:
        return why
    if shutil.which("nsenter") is None or shutil.which("unshare") is None:
        return "needs nsenter and unshare (util-linux)"
    try:
        locate_criu("auto")
    except CheckpointUnavailable as error:
        return f"no usable CRIU: {error}"
    return ""


def other_uid_for_owner(root: Path) -> dict[str, Path]:
    """An account database for node-c in which sing-alice has another uid."""
    ensure_user(OWNER)
    passwd = root / "passwd-c"
    lines = Path("/etc/passwd").read_text().splitlines()
    passwd.write_text(
        "\n".join(
            ":".join([f[0], f[1], str(OTHER_UID), *f[3:]]) if f[0] == OWNER else line
            for line in lines
            for f in [line.split(":")]
        )
        + "\n"
    )
    return {"node-c": passwd}


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    """node-a, node-b, node-c joined in a lab; node-c's accounts give sing-alice another uid."""
    why = lab_problem()
    if why:
        pytest.skip(why)
    config = {"move_timeout_seconds": 60.0, "move_hold_seconds": 60.0, "move_process_base": True}
    with joined_lab(NODES, f"lab{os.getpid()}", config, other_uid_for_owner) as made:
        yield made


def submit_train(node: Node, release: Path, steps: int = STEPS, *options: str) -> int:
    """Submit the proxied training program; it holds before its last line until `release` exists."""
    result = node.sing(
        "submit", *JOB_OPTIONS, *options, "--", PYTHON, "long_train.py", "--steps", str(steps),
        "--hold", str(release),
    )  # fmt: skip
    assert result.code == 0, result.err
    return int(result.out.strip())


def steps_done(node: Node, job: int) -> int:
    """How many training steps the job's log on `node` shows."""
    log = node.rank_log(job)
    return log.read_text().count("step ") if log.exists() else 0


def progressed(node: Node, job: int, beyond: int) -> Callable[[], bool]:
    """Whether the job's log on `node` shows more than `beyond` steps."""
    return lambda: steps_done(node, job) > beyond


def wait_state(node: Node, job: int, *states: str, timeout: float = 120.0) -> dict[str, Any]:
    """Poll `sing show` on a node until the job is in one of the states."""

    def reached() -> dict[str, Any] | None:
        shown = node.job(job)
        return shown if shown is not None and shown["state"] in states else None

    found: dict[str, Any] = wait_until(reached, timeout, interval=0.2)
    return found


def migrate(source: Node, job: int, target: str) -> None:
    """`sing migrate` that must succeed; the job then runs on `target`."""
    result = source.sing("migrate", str(job), "--to", target, timeout=300)
    assert result.code == 0, f"{result.err}\n{source.log.read_text()[-4000:]}"
    assert result.out.strip() == f"job {job} moved to {target}"


def cluster_listing(node: Node) -> list[dict[str, Any]]:
    """`sing ps --cluster -o json` on a node."""
    result = node.sing("ps", "--cluster", "-o", "json")
    assert result.code == 0, result.err
    listing: list[dict[str, Any]] = result.json()
    return listing


class MoveWatcher:
    """Polls `sing show` on a node during a move and keeps every move phase it saw."""

    def __init__(self, node: Node, job: int) -> None:
        self.node, self.job = node, job
        self.seen: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            shown = self.node.job(self.job)
            if shown is not None and shown.get("move"):
                self.seen.append(shown["move"])

    def stop(self) -> list[dict[str, Any]]:
        """Stop polling; the move phases seen."""
        self._stop.set()
        self._thread.join(30)
        return self.seen


def test_a_job_moved_around_the_lab_at_random_moments_is_exact(lab: Lab) -> None:
    expected = direct_output("long_train.py", ["--steps", str(STEPS)])
    rng = random.Random(int(os.environ.get("SING_LAB_SEED", "12")))
    release = lab.paths.root / f"release-{rng.random()}"
    a, b, c = (lab.node(name) for name in NODES)
    job = submit_train(a, release)
    wait_state(a, job, "RUNNING")
    route = [(a, b), (b, c), (c, a)]
    seen = 0
    for source, target in route:
        beyond = seen + rng.randint(5, 60)
        wait_until(progressed(source, job, min(beyond, STEPS - 1)), timeout=240)
        time.sleep(rng.uniform(0.0, 0.5))
        watcher = MoveWatcher(source, job)
        waiting = Background(functools.partial(source.sing, "wait", str(job), timeout=300))
        following = Background(functools.partial(source.sing, "logs", "-f", str(job), timeout=300))
        migrate(source, job, target.name)
        for ended, says in ((waiting.result(), "wait for it there"), (following.result(), "goes on there")):
            assert ended.code == 6 and f"moved to {target.name}" in ended.err and says in ended.err, ended
        assert expected.startswith(following.result().out)  # what it printed here, no more
        moved_away = source.sing("logs", str(job))
        assert moved_away.code == 6 and "its output is there" in moved_away.err, moved_away
        phases = watcher.stop()
        assert {p["peer"] for p in phases} <= {target.name}
        assert any(p["phase"] == "sending" and p["total"] > 0 for p in phases) or not phases
        wait_state(target, job, "RUNNING")
        assert source.job(job)["state"] == "MOVED"  # type: ignore[index]
        for node in (a, b, c):
            listed = [j for j in cluster_listing(node) if j["id"] == job]
            assert [(j["node"], j["state"]) for j in listed] == [(target.name, "RUNNING")], node.name
        seen = steps_done(target, job)
    release.touch()
    result = a.sing("wait", str(job), timeout=300)
    assert result.code == 0, a.sing("logs", str(job)).out[-2000:]
    assert a.sing("logs", str(job)).out == expected
    events = [e["reason"] for e in a.job(job)["events"]]  # type: ignore[index]
    assert sum("restored frozen; waiting for the commit" in e for e in events) == 3
    restores = [e for e in events if e.startswith("restore frozen took")]
    assert len(restores) == 3 and all("(0B read and hashed)" in e for e in restores), restores
    assert any(e.startswith("moved to node-b (epoch 2)") for e in events)
    assert any(e.startswith("commit from node-a: the job runs here (epoch 2)") for e in events)
    assert any(e.startswith("commit from node-c: the job runs here (epoch 4)") for e in events)
    on_b = [e["reason"] for e in b.job(job)["events"]]  # type: ignore[index]
    assert "moved to node-c (epoch 3)" in on_b and b.job(job)["state"] == "MOVED"  # type: ignore[index]


def test_a_two_rank_job_moved_around_the_lab_is_exact(lab: Lab) -> None:
    """Both ranks (gloo on the CPU, TCP between them) move at once and resume exactly; c10d's
    warning that a node's network has no name service is left out."""
    steps = 150
    expected = direct_ddp_outputs(steps)
    release = lab.paths.root / "release-ddp"
    a, b, c = (lab.node(name) for name in NODES)
    env_options = [f"--env={key}={value}" for key, value in JOB_ENV.items()]
    command = [PYTHON, str(DDP_SCRIPT), "--steps", str(steps), "--sleep", "0.02", "--hold", str(release)]
    result = a.sing("submit", *env_options, "--ranks", "2", "--", *command)
    assert result.code == 0, result.err
    job = int(result.out)
    wait_state(a, job, "RUNNING")
    for index, (source, target) in enumerate([(a, b), (b, c), (c, a)]):
        wait_until(progressed(source, job, 20 + 40 * index), timeout=240)
        migrate(source, job, target.name)
        wait_state(target, job, "RUNNING")
    release.touch()
    assert a.sing("wait", str(job), timeout=300).code == 0
    outputs = [a.sing("logs", "--rank", str(rank), str(job)).out for rank in range(2)]
    assert [without_name_lookup_warnings(output) for output in outputs] == expected


def test_a_job_whose_ranks_share_a_device_moves_and_resumes_exactly(lab: Lab) -> None:
    """Two DDP ranks spliced on one virtual device: the target restored them seeing one device
    ("restore failed: list index out of range") and the move was refused; they see two there too,
    and print what the same job prints unmoved on another node."""
    a, b, c = (lab.node(name) for name in NODES)
    release = lab.paths.root / "release-spliced"
    args = [PYTHON, "ddp_train.py", "--steps", "40", "--hook", "allreduce", "--hold", str(release)]
    options = [*JOB_OPTIONS, "--ranks", "2", "--gpus", "1"]
    moved, unmoved = (int(node.sing("submit", *options, "--", *args).out) for node in (a, c))
    wait_until(progressed(a, moved, 5), timeout=240)
    migrate(a, moved, b.name)
    assert wait_state(b, moved, "RUNNING")["devices"] != []
    release.touch()
    assert b.sing("wait", str(moved), timeout=600).code == 0
    assert c.sing("wait", str(unmoved), timeout=600).code == 0
    logs = [rank_logs(node, job, 2) for node, job in ((b, moved), (c, unmoved))]
    assert printed(logs[0]) == printed(logs[1]) and "rank 1 final" in logs[0][1]


def expect_refusal(node: Node, args: list[str], code: int, text: str) -> str:
    """A command that must fail with one line containing `text` and exit `code`."""
    result = node.sing(*args, timeout=300)
    assert (result.code, result.out) == (code, ""), result
    assert text in result.err and result.err.count("\n") == 1, result.err
    return result.err


class Background:
    """A call run on a thread; `result()` waits for what it returned."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self._value: Any = None
        self._thread = threading.Thread(target=lambda: setattr(self, "_value", call()), daemon=True)
        self._thread.start()

    def done(self) -> bool:
        """Whether the call has returned."""
        return not self._thread.is_alive()

    def result(self, timeout: float = 300.0) -> Any:
        """What the call returned, once it has."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the call did not return"
        return self._value


def peer_state(node: Node, peer: str) -> str:
    """How `sing peers` on `node` describes `peer`."""
    peers = node.sing("peers", "-o", "json").json()["peers"]
    return str(next(p["state"] for p in peers if p["node"] == peer))


def test_bad_moves_are_refused_with_one_line_and_the_job_keeps_running(lab: Lab) -> None:
    a, b, _ = (lab.node(name) for name in NODES)
    release = lab.paths.root / "release-bad"
    job = submit_train(a, release, 100_000)
    wait_state(a, job, "RUNNING")
    wait_until(lambda: steps_done(a, job) > 3, timeout=120)
    expect_refusal(a, ["migrate", "999999999", "--to", "node-b"], 4, "not found")
    expect_refusal(a, ["migrate", str(job), "--to", "node-z"], 2, "no peer named node-z")
    expect_refusal(a, ["migrate", str(job), "--to", ""], 2, "must not be empty")
    expect_refusal(a, ["migrate", str(job), "--to", "node-a"], 2, "already on node-a")
    expect_refusal(b, ["migrate", str(job), "--to", "node-c"], 4, "not found")

    held = a.sing("submit", "--", "sleep", "600").out.strip()
    assert a.sing("suspend", held).code == 0
    expect_refusal(a, ["migrate", held, "--to", "node-b"], 6, "only a RUNNING job can be migrated")

    blockers = [b.sing("submit", "--", "sleep", "600").out.strip() for _ in range(2)]
    for blocker in blockers:
        wait_state(b, int(blocker), "RUNNING")
    expect_refusal(a, ["migrate", str(job), "--to", "node-b"], 6, "node-b refused the job: no room")
    assert b.sing("cancel", *blockers).code == 0

    (a.folder / "work").mkdir()
    (a.folder / "work" / "data.txt").write_text("only on node-a\n")
    (b.folder / "work").mkdir()
    elsewhere = a.sing("submit", "--cwd", str(lab.paths.common / "work"), "--", "sleep", "600")
    assert elsewhere.code == 0, elsewhere.err
    wait_state(a, int(elsewhere.out), "RUNNING")
    expect_refusal(a, ["migrate", elsewhere.out.strip(), "--to", "node-b"], 6, "lacks data.txt")
    expect_refusal(a, ["migrate", elsewhere.out.strip(), "--to", "node-c"], 6, "does not exist on this node")
    assert a.sing("cancel", elsewhere.out.strip()).code == 0
    wait_state(a, int(elsewhere.out), "CANCELLED")

    alices = a.sing("submit", "--cwd", "/tmp", "--", "sleep", "600", user=OWNER)
    assert alices.code == 0, alices.err
    wait_state(a, int(alices.out), "RUNNING")
    expect_refusal(
        a, ["migrate", alices.out.strip(), "--to", "node-c"], 6, f"has uid {OTHER_UID} on this node"
    )

    assert steps_done(a, job) > 3 and a.job(job)["state"] == "RUNNING"  # type: ignore[index]
    assert a.sing("cancel", str(job), held, alices.out.strip()).code == 0


def test_a_peer_down_or_vanishing_mid_move_leaves_the_job_running_here(lab: Lab) -> None:
    a, b, c = (lab.node(name) for name in NODES)
    release = lab.paths.root / "release-vanish"
    job = submit_train(a, release, 100_000)
    wait_state(a, job, "RUNNING")
    wait_until(lambda: steps_done(a, job) > 3, timeout=120)

    c.kill(signal.SIGTERM)
    wait_until(lambda: peer_state(a, "node-c") == "dead", timeout=60)
    expect_refusal(a, ["migrate", str(job), "--to", "node-c"], 6, "peer node-c is down")
    leftovers = [
        c.state_dir / "checkpoints" / ".outgoing" / "77@3.pre",
        c.state_dir / "checkpoints" / ".incoming" / "78@2",
    ]
    for folder in leftovers:  # as a daemon killed mid-move leaves them
        (folder / "images").mkdir(parents=True)
        (folder / "images" / "pages-1.img").write_bytes(bytes(1 << 20))
    c.start()

    mover = Background(lambda: a.sing("migrate", str(job), "--to", "node-b", timeout=300))
    wait_until(lambda: (b.holding(job) or {}).get("phase") == "in-prepared", timeout=60, interval=0.005)
    b.kill(signal.SIGKILL)
    result = mover.result()
    assert result.code == 6 and result.err.startswith(f"sing: job {job} did not move to node-b: "), result
    assert result.err.count("\n") == 1, result.err
    # Checked right before the job would pause, node-b made the move fail with the job never stopped;
    # killed later, it was given up on once silent for the sending's patience, not after every retry.
    assert "node-b does not answer; the job was not stopped" in result.err or (
        "the receiver has not answered for" in result.err
    ), result.err
    wait_state(a, job, "RUNNING")
    before = steps_done(a, job)
    b.start()
    lab.wait_all_alive()
    wait_until(lambda: steps_done(a, job) > before, timeout=120)
    assert [j["node"] for j in cluster_listing(c) if j["id"] == job] == ["node-a"]
    assert not any(folder.exists() for folder in leftovers)
    wait_until(lambda: not (a.holding(job) or {}).get("abort_pending"), timeout=60)
    assert (b.holding(job) or {}).get("phase") == "discarded"
    assert a.sing("cancel", str(job)).code == 0


def owner_of(lab: Lab, job: int) -> Node:
    """The node `sing ps --cluster` names for a job (asked of node-a), once it is listed once."""

    def listed() -> str | None:
        rows = [row for row in cluster_listing(lab.node("node-a")) if row["id"] == job]
        return str(rows[0]["node"]) if len(rows) == 1 else None

    return lab.node(wait_until(listed, timeout=120, interval=0.5))


def with_identity(lab: Lab, node: Node, files: dict[str, bytes], expected: str) -> None:
    """Restart `node` with these certificate files in place of its own; node-a must log the
    refusal `expected` of it, refuse to move a job there, and keep the job; then undo it."""
    a = lab.node("node-a")
    cluster = node.state_dir / "cluster"
    own = {name: (cluster / name).read_bytes() for name in files}
    job = a.sing("submit", "--", "sleep", "600").out.strip()
    try:
        node.kill(signal.SIGTERM)
        for name, data in files.items():
            (cluster / name).write_bytes(data)
        node.start()
        wait_until(lambda: expected in a.log.read_text(errors="replace"), timeout=120, interval=0.5)
        wait_state(a, int(job), "RUNNING")
        moved = a.sing("migrate", job, "--to", node.name, timeout=300)
        assert moved.code != 0 and moved.err.count("\n") == 1, moved
        assert a.job(int(job))["state"] == "RUNNING"  # type: ignore[index]
        assert node.job(int(job)) is None
    finally:
        a.sing("cancel", job)
        node.kill(signal.SIGTERM)
        for name, data in own.items():
            (cluster / name).write_bytes(data)
        node.start()
        lab.wait_all_alive()


def test_full_daemons_refuse_a_peer_of_another_ca_or_naming_another_node(lab: Lab) -> None:
    c = lab.node("node-c")
    foreign = Pki(lab.paths.root / "foreign-ca")
    made = foreign.init("another-lab", "node-x", time.time())
    joiner = Pki(lab.paths.root / "foreign-c")
    cert, ca = foreign.sign_request(str(made.token), joiner.join_request("node-c"), time.time())
    joiner.install(cert, ca, made.ca_fingerprint, "node-c")
    names = ("ca.crt", "node.crt", "node.key")
    foreign_files = {name: (joiner.root / name).read_bytes() for name in names}
    address = lab.network.nodes["node-c"].address
    with_identity(lab, c, foreign_files, f"refused {address}")
    stolen = {name: (lab.node("node-b").state_dir / "cluster" / name).read_bytes() for name in names[1:]}
    with_identity(lab, c, stolen, "its certificate does not name node-c")


def test_submit_anywhere_starts_a_job_that_cannot_start_here_on_a_peer(lab: Lab) -> None:
    a = lab.node("node-a")
    blockers = [a.sing("submit", "--", "sleep", "600").out.strip() for _ in range(2)]
    for blocker in blockers:
        wait_state(a, int(blocker), "RUNNING")
    here = a.sing("submit", "--here", "--", "sleep", "600")
    anywhere = a.sing("submit", "--anywhere", "--", "sleep", "600")
    assert here.code == 0 and anywhere.code == 0, (here, anywhere)
    job = int(anywhere.out)
    owner = owner_of(lab, job)
    assert owner.name in ("node-b", "node-c")
    wait_state(owner, job, "RUNNING")
    assert a.job(job)["state"] == "MOVED"  # type: ignore[index]
    assert wait_state(a, int(here.out), "PENDING")["pending_reason"]
    assert 1_000_000 < job < 2_000_000, "its id comes from node-a's block, wherever it runs"
    assert owner.sing("cancel", str(job)).code == 0

    # With no room anywhere, such a job waits here until a peer has some, then goes there.
    b, c = lab.node("node-b"), lab.node("node-c")
    fill_b, fill_c = (
        [node.sing("submit", "--", "sleep", "600").out.strip() for _ in range(2)] for node in (b, c)
    )
    for node, jobs in ((b, fill_b), (c, fill_c)):
        for each in jobs:
            wait_state(node, int(each), "RUNNING")
    waiting = int(a.sing("submit", "--anywhere", "--", "sleep", "600").out)
    time.sleep(3)  # a few heartbeats and placement rounds
    assert a.job(waiting)["state"] == "PENDING"  # type: ignore[index]
    assert b.sing("cancel", fill_b.pop()).code == 0
    wait_state(b, waiting, "RUNNING", timeout=60)
    assert a.job(waiting)["state"] == "MOVED"  # type: ignore[index]
    assert b.sing("cancel", str(waiting), *fill_b).code == 0
    assert c.sing("cancel", *fill_c).code == 0
    assert a.sing("cancel", here.out.strip(), *blockers).code == 0


def test_drain_moves_every_job_away_and_undrain_takes_jobs_again(lab: Lab) -> None:
    c = lab.node("node-c")
    expected = direct_output("long_train.py", ["--steps", "80"])
    release = lab.paths.root / "release-drain"
    suspended = int(c.sing("submit", "--", "sleep", "600").out)
    wait_state(c, suspended, "RUNNING")
    assert c.sing("suspend", str(suspended), timeout=300).code == 0
    wait_state(c, suspended, "SUSPENDED")
    training = submit_train(c, release, 80)
    sleeper = int(c.sing("submit", "--", "sleep", "600").out)
    wait_state(c, training, "RUNNING")
    wait_state(c, sleeper, "RUNNING")
    wait_until(progressed(c, training, 10), timeout=120)
    drained = c.sing("drain", timeout=600)
    assert drained.code == 0, drained.err
    moved = sorted(line.split()[1] for line in drained.out.splitlines())
    assert moved == sorted([str(training), str(sleeper), str(suspended)]), drained.out
    held = owner_of(lab, suspended)  # it stays suspended there until resumed
    assert wait_state(held, suspended, "SUSPENDED")["reason"].endswith("suspended here until `sing resume`")
    assert held.sing("resume", str(suspended), "--wait", timeout=300).code == 0
    wait_state(held, suspended, "RUNNING")
    assert c.sing("ps", "-o", "json").json() == []
    peers = lab.node("node-a").sing("peers", "-o", "json").json()["peers"]
    wait_until(lambda: any(p["node"] == "node-c" and p["draining"] for p in peers) or None, timeout=1)
    expect_refusal(c, ["submit", "--here", "--", "sleep", "1"], 6, "draining")
    placed = c.sing("submit", "--anywhere", "--", "sleep", "600")
    assert placed.code == 0, placed.err
    assert owner_of(lab, int(placed.out)).name != "node-c"
    assert c.sing("undrain").code == 0
    local = c.sing("submit", "--here", "--", "sleep", "600")
    wait_state(c, int(local.out), "RUNNING")
    owner = owner_of(lab, training)  # while it runs: `ps --cluster` lists no ended job
    release.touch()
    assert owner.sing("wait", str(training), timeout=300).code == 0
    assert owner.sing("logs", str(training)).out == expected
    for job in (sleeper, suspended, int(placed.out), int(local.out)):
        assert owner_of(lab, job).sing("cancel", str(job)).code == 0


async def test_sing_top_shows_the_peers_and_migrates_a_job(lab: Lab) -> None:
    """`sing top` on node-a: the peers pane lists node-b and node-c alive, and `m`, a peer, `y`
    move the chosen job there."""
    a, b = lab.node("node-a"), lab.node("node-b")
    job = int(a.sing("submit", "--name", "top-move", "--", "sleep", "600").out)
    wait_state(a, job, "RUNNING")
    app = TopApp(DaemonSource(a.socket), refresh_seconds=0.2)
    async with app.run_test(size=(150, 46)) as pilot:

        async def until(predicate: Callable[[], Any], timeout: float = 120.0) -> Any:
            deadline = time.monotonic() + timeout
            while not (value := predicate()):
                assert time.monotonic() < deadline, f"timed out waiting for {predicate}"
                await pilot.pause(0.1)
            return value

        peers = app.query_one("#peers", DataTable)
        await until(lambda: peers.display and {"peer:node-b", "peer:node-c"} <= {r.value for r in peers.rows})
        assert str(peers.border_title).startswith("Peers of node-a")
        # free devices come with heartbeats: wait until node-b is offered (alive, with room)
        await until(lambda: any(p.node == "node-b" for p in view.migration_targets(app.peers, 1)))
        await pilot.press("slash", *"top-move", "enter")
        await until(lambda: app.selected == job)
        await pilot.press("m")
        assert isinstance(app.screen, ChoiceScreen)
        number = 1 + [node for node, _ in app.screen.choices].index("node-b")
        await pilot.press(str(number), "y")
        await until(lambda: any(n == f"job {job}: moved to node-b" for n in app.notices), timeout=300)
    wait_state(b, job, "RUNNING")
    assert a.job(job)["state"] == "MOVED"  # type: ignore[index]
    assert b.sing("cancel", str(job)).code == 0


def test_a_moved_job_sends_its_process_images_as_changes_against_a_base(lab: Lab) -> None:
    """With move_process_base (on in this lab), the images dumped while the job ran go to the target
    first; after the stop only a small part of the final checkpoint travels, the target rebuilds
    the rest, and the job still ends byte-identical to an uninterrupted run."""
    expected = direct_output("long_train.py", ["--steps", str(STEPS)])
    release = lab.paths.root / "release-base"
    a, b = lab.node("node-a"), lab.node("node-b")
    job = submit_train(a, release)
    wait_state(a, job, "RUNNING")
    wait_until(progressed(a, job, 40), timeout=240)
    migrate(a, job, "node-b")
    running = wait_state(b, job, "RUNNING")
    image = int(running["last_checkpoint"]["bytes"])  # the one it arrived with (an ended job's go)
    release.touch()
    assert b.sing("wait", str(job), timeout=300).code == 0, b.sing("logs", str(job)).out[-2000:]
    assert b.sing("logs", str(job)).out == expected
    arrived, left = b.job(job), a.job(job)
    assert arrived is not None and left is not None
    events = [e["reason"] for e in left["events"]]
    assert any(" base of its process images to node-b in " in e for e in events), events
    assert any(e.startswith("process images (") and " of changes against the base" in e for e in events)
    rebuilt = [e["reason"] for e in arrived["events"] if e["reason"].startswith("rebuilt ")]
    assert len(rebuilt) == 1 and " drafts copied from the base while the job ran" in rebuilt[0], rebuilt
    after = [e for e in events if e.startswith("sent ") and " after the stop (" in e]
    assert len(after) == 1, events
    sent = int(after[0].split(" after the stop (")[1].split(" bytes")[0])
    assert 0 < sent < image // 8, (sent, image)
