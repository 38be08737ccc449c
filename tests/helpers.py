"""Test helpers: a real singularityd on a temporary socket and state directory, and the real `sing`."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import grp
import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from singularityd.checkpoint.precheck import CAP_SYS_RESOURCE, have_capability
from singularityd.jobs.launch import probe_user_namespaces

OWNER = "sing-alice"
ACCOUNTS_LOCK = "/tmp/sing-test-accounts.lock"
BIN = Path(sys.executable).parent
SING = str(BIN / "sing")
SINGULARITYD = str(BIN / "singularityd")
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Result:
    """What a finished `sing` command printed and returned."""

    code: int
    out: str
    err: str

    def json(self) -> Any:
        """stdout parsed as JSON."""
        return json.loads(self.out)


def invert_bytes(path: Path, offset: int, count: int = 1) -> None:
    """Damage a file: invert every bit of `count` bytes at `offset` (so they differ, whatever they held)."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        held = handle.read(count)
        handle.seek(offset)
        handle.write(bytes(byte ^ 0xFF for byte in held))


def wait_until(predicate: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05) -> Any:
    """Poll until the predicate returns something truthy; fail the test on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {predicate}")
        time.sleep(interval)


class PrintedLines:
    """The lines a running process prints, collected by a thread as they come."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        self.lines: list[str] = []
        self._stream = process.stdout
        self._thread = threading.Thread(target=self._collect, daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        for line in self._stream:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, predicate: Callable[[list[str]], Any], timeout: float = 60.0) -> Any:
        """Wait until the predicate holds for the lines printed so far; returns its value."""
        return wait_until(lambda: predicate(list(self.lines)), timeout)


@dataclass
class Daemon:
    """A singularityd process driven by the tests."""

    root: Path
    virtual_devices: int = 4
    config: dict[str, Any] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    log_level: str | None = "debug"
    """Given as --log-level (None: the config file's log_level rules)."""

    @property
    def socket(self) -> Path:
        """The API socket."""
        return self.root / "run" / "sing.sock"

    @property
    def state_dir(self) -> Path:
        """The state directory."""
        return self.root / "state"

    @property
    def log(self) -> Path:
        """The daemon's own stderr."""
        return self.root / "daemon.log"

    def write_config(self) -> Path:
        """The TOML file the daemon reads (settings from `config`)."""
        path = self.root / "singularityd.toml"
        lines = [f"{key} = {json.dumps(value)}" for key, value in self.config.items()]
        path.write_text("\n".join(lines) + "\n")
        return path

    def start(self, timeout: float = 30.0) -> None:
        """Start the daemon and return once it told systemd's protocol it is ready."""
        self.root.mkdir(parents=True, exist_ok=True)
        notify_path = self.root / "notify.sock"
        notify_path.unlink(missing_ok=True)
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(notify_path))
        notify.settimeout(timeout)
        env = {**os.environ, "NOTIFY_SOCKET": str(notify_path)}
        env.pop("SING_SOCKET", None)
        log = self.log.open("ab")
        self.process = subprocess.Popen(
            [
                SINGULARITYD,
                "--config",
                str(self.write_config()),
                "--socket",
                str(self.socket),
                "--state-dir",
                str(self.state_dir),
                "--devices",
                "virtual",
                "--virtual-devices",
                str(self.virtual_devices),
                *(["--log-level", self.log_level] if self.log_level else []),
            ],
            stdout=log,
            stderr=log,
            env=env,
        )
        log.close()
        try:
            while True:
                message = notify.recv(4096).decode()
                if "READY=1" in message:
                    break
        except TimeoutError:
            self.process.kill()
            raise AssertionError(f"daemon not ready in {timeout}s:\n{self.log.read_text()}") from None
        finally:
            notify.close()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send a signal to the daemon and wait for it to exit; returns its exit status."""
        assert self.process is not None
        self.process.send_signal(sig)
        code = self.process.wait(timeout)
        self.process = None
        return code

    def sing(self, *args: str, user: str | None = None, timeout: float = 60.0, **env: str) -> Result:
        """Run the real `sing` against this daemon (as another user when given)."""
        return run_sing(args, socket_path=self.socket, user=user, timeout=timeout, env=env)

    def job(self, job_id: int) -> dict[str, Any]:
        """`sing show ID -o json`, parsed."""
        result = self.sing("show", str(job_id), "-o", "json")
        assert result.code == 0, result.err
        data: dict[str, Any] = result.json()
        return data

    def wait_state(self, job_id: int, *states: str, timeout: float = 120.0) -> dict[str, Any]:
        """Poll until the job is in one of the states; returns its JSON. The default wait is long:
        a resume queued behind other tests' checkpoints on two shared cores can take over 30 s."""

        def reached() -> dict[str, Any] | None:
            job = self.job(job_id)
            return job if job["state"] in states else None

        result: dict[str, Any] = wait_until(reached, timeout)
        return result

    def wait_ok(self, job_id: int, timeout: float = 300.0) -> None:
        """Wait for the job to end and fail, with its reason, events, log and the daemon's log, unless
        it exited 0."""
        code = self.sing("wait", str(job_id), timeout=timeout).code
        if code == 0:
            return
        job = self.job(job_id)
        events = "\n".join(f"  {e.get('to_state', '')}: {e.get('reason', '')}" for e in job["events"])
        printed = self.sing("logs", str(job_id)).out
        raise AssertionError(
            f"job {job_id} ended with {code} ({job['state']}: {job['reason']})\nevents:\n{events}\n"
            f"its log (end):\n{printed[-3000:]}\nthe daemon's log (end):\n{self.log.read_text()[-6000:]}"
        )

    def supervisor_pid(self, job_id: int) -> int:
        """The host PID of the job's supervisor, from the file the launcher writes (once written)."""
        path = self.state_dir / "jobs" / str(job_id) / "init.pid"
        return int(wait_until(lambda: path.exists() and path.read_text().split()[:1])[0])

    def submit(self, *command: str, options: Sequence[str] = (), user: str | None = None) -> int:
        """Submit a job and return its id."""
        result = self.sing("submit", *options, "--", *command, user=user)
        assert result.code == 0, result.err
        return int(result.out.strip())


def submit_counter(daemon: Daemon, release: Path, *options: str, first: str = "") -> int:
    """Submit a job printing 0, 1, 2... (one line every 20 ms) until `release` exists, then 'end';
    `first`: Python lines it runs before."""
    script = (
        first + "import os, time\n"
        "i = 0\n"
        f"while not os.path.exists({str(release)!r}):\n"
        "    print(i, flush=True)\n"
        "    i += 1\n"
        "    time.sleep(0.02)\n"
        "print('end', flush=True)\n"
    )
    return daemon.submit(sys.executable, "-c", script, options=["--name", "counter", *options])


def python_for_user(user: str) -> list[str] | None:
    """A Python command line, with this project importable, that another user can run; or None.

    The test venv's interpreter may live where other users cannot reach it (a pyenv under /root):
    then a system Python of the same minor version with this checkout and the venv's
    site-packages on PYTHONPATH serves, when the user can read those.
    """
    account = pwd.getpwnam(user)
    site_packages = next(p for p in sys.path if p.endswith("site-packages"))
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [sys.executable, f"/usr/bin/{version}", f"/usr/local/bin/{version}"]
    env = {"PYTHONPATH": f"{REPO}:{site_packages}", "PATH": os.environ.get("PATH", "")}
    for candidate in candidates:
        if not Path(candidate).exists():
            continue
        try:
            probe = subprocess.run(
                [candidate, "-c", "import singularity.cli.main, singularityd.daemon"],
                user=account.pw_uid, group=account.pw_gid, env=env, capture_output=True, cwd="/",
            )  # fmt: skip
        except OSError:
            continue
        if probe.returncode == 0:
            return ["env", f"PYTHONPATH={env['PYTHONPATH']}", candidate]
    return None


def run_sing(
    args: Sequence[str],
    *,
    socket_path: Path | None,
    user: str | None = None,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> Result:
    """Run `sing` with its output captured."""
    full_env = {**os.environ, **(env or {})}
    if socket_path is not None:
        full_env["SING_SOCKET"] = str(socket_path)
    command = [SING, *args]
    kwargs: dict[str, Any] = {}
    if user is not None:
        python = python_for_user(user)
        if python is None:
            pytest.skip(f"no Python with this project importable by {user} here")
        command = [*python, "-m", "singularity.cli.main", *args]
        account = pwd.getpwnam(user)
        full_env.update(HOME=account.pw_dir, USER=user, LOGNAME=user)
        kwargs.update(
            user=account.pw_uid, group=account.pw_gid, extra_groups=os.getgrouplist(user, account.pw_gid)
        )
        cwd = cwd or "/tmp"
    completed = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd, **kwargs
    )
    return Result(completed.returncode, completed.stdout, completed.stderr)


def ensure_user(name: str, groups: Sequence[str] = ()) -> pwd.struct_passwd:
    """Create a system user for the test if missing (needs root), in the given groups; one test
    process at a time, since useradd refuses to run while another holds the account files."""
    with open(ACCOUNTS_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _ensure_user(name, groups)


def _ensure_user(name: str, groups: Sequence[str]) -> pwd.struct_passwd:
    for group in groups:
        try:
            grp.getgrnam(group)
        except KeyError:
            subprocess.run(["groupadd", "--system", group], check=True)
    try:
        account = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            [
                "useradd",
                "--system",
                "--no-create-home",
                "--home-dir",
                "/nonexistent",
                "--shell",
                "/bin/sh",
                name,
            ],
            check=True,
        )
        account = pwd.getpwnam(name)
    for group in groups:
        if name not in grp.getgrnam(group).gr_mem:
            subprocess.run(["usermod", "--append", "--groups", group, name], check=True)
    return account


@contextlib.contextmanager
def running_daemon(root: Path, **kwargs: Any) -> Iterator[Daemon]:
    """A started daemon that is stopped (SIGTERM, then SIGKILL) at the end."""
    daemon = Daemon(root, **kwargs)
    daemon.start()
    try:
        yield daemon
    finally:
        if daemon.process is not None:
            daemon.process.terminate()
            try:
                daemon.process.wait(15)
            except subprocess.TimeoutExpired:
                daemon.process.kill()
                daemon.process.wait()


@functools.cache
def user_namespace_problem() -> str | None:
    """None where root can checkpoint other users' jobs directly (it holds CAP_SYS_RESOURCE); else
    "" where it does so through user namespaces, or why it cannot."""
    if have_capability(CAP_SYS_RESOURCE):
        return None
    return probe_user_namespaces()


def other_user() -> str:
    """A second (non-root) user whose jobs this machine can checkpoint; skips where none can be."""
    problem = user_namespace_problem()
    if problem:
        pytest.skip(f"root lacks CAP_SYS_RESOURCE and user namespaces do not work: {problem}")
    ensure_user(OWNER)
    return OWNER


def steps_done(daemon: Daemon, job: int, ranks: int) -> int:
    """The fewest steps any rank of the job has printed so far."""
    logs = [daemon.state_dir / "jobs" / str(job) / "logs" / f"rank-{rank}.log" for rank in range(ranks)]
    return min(log.read_text().count(" step ") if log.exists() else 0 for log in logs)


def trained_beyond(daemon: Daemon, job: int, ranks: int, beyond: int) -> bool:
    """Whether every rank of the job printed more than `beyond` steps."""
    return steps_done(daemon, job, ranks) > beyond


def preempt_while_training(
    daemon: Daemon,
    job: int,
    ranks: int,
    total: int,
    times: int,
    *,
    wait_timeout: float,
    before: Callable[[], object] = lambda: None,
    after: Callable[[], object] = lambda: None,
    still_training: bool = False,
) -> None:
    """Preempt a running job `times` times, each once every rank trained past the steps seen when
    it ran again the time before (at most `total`), and wait for it to run again. `before` runs
    before each preemption, `after` once the job runs again; with `still_training`, the job must
    not have printed all its `total` steps by the last. A job left by a failure is cancelled: it
    would wait for its release file forever."""
    try:
        seen = 0
        for _ in range(times):
            beyond = min(seen, total - 1)
            wait_until(functools.partial(trained_beyond, daemon, job, ranks, beyond), timeout=wait_timeout)
            before()
            result = daemon.sing("preempt", str(job), timeout=300)
            assert result.code == 0, result.err
            daemon.wait_state(job, "RUNNING", timeout=300)
            after()
            seen = steps_done(daemon, job, ranks)
        if still_training:
            assert seen < total, "the job was still training when preempted the last time"
    except BaseException:
        daemon.sing("cancel", str(job))
        raise
