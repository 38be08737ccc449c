"""The everyday CLI against a real daemon: --version, -o and --no-header, the config file, progress
on a terminal, and `logs -f` following a job through daemon restarts, preemption and resumption."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from singularity.cli import output
from singularity.cli.config import CliSettings, parse_settings
from singularity.cli.errors import CliError
from singularity.cli.source import LogFollower
from singularityd import __version__
from singularityd.api.v1 import singularity_pb2 as pb
from tests.conftest import requires_root
from tests.helpers import SING, Daemon, run_sing, running_daemon, submit_counter, wait_until

LIVE_USAGE = ("cpu_seconds", "rss_bytes")


def sing_env(daemon: Daemon, **extra: str) -> dict[str, str]:
    """The environment for a `sing` subprocess talking to this daemon."""
    return {**os.environ, "SING_SOCKET": str(daemon.socket), **extra}


def test_a_table_row_stays_one_line_whatever_its_cells_hold() -> None:
    """A job name with a newline broke the `ps` table; a terminal escape in one would reach the
    user's terminal."""
    rows = [["1", "two\nlines\tand a tab", "x"], ["2", "red\x1b[31m", "y"]]
    text = output.table(rows, ["ID", "NAME", "CMD"])
    assert text.splitlines() == [
        "ID  NAME                   CMD",
        "1   two\\nlines\\tand a tab  x",
        "2   red\\x1b[31m            y",
    ]


def test_show_prints_a_jobs_command_and_folder_with_their_escapes_inert() -> None:
    """`sing show` of another user's job passed its terminal escapes (window title, colours,
    clearing the screen) to the admin's terminal, and a newline in its command forged lines."""
    job = pb.Job(id=7, name="x", command=["printf", "\x1b]0;owned\x07", "a\nUser: root"], cwd="/tmp/\x1b[2J")
    text = output.job_detail_text(pb.JobDetail(job=job))
    assert "\x1b" not in text and "\x07" not in text
    assert "Command:    printf \\x1b]0;owned\\x07 a\\nUser: root" in text.splitlines()
    assert "Directory:  /tmp/\\x1b[2J" in text.splitlines()


def test_version() -> None:
    for flag in ("--version", "-V"):
        result = run_sing([flag], socket_path=None)
        assert (result.code, result.out, result.err) == (0, f"sing {__version__}\n", "")


@pytest.mark.parametrize(
    ("args", "command", "said"),
    [
        (["submit", "--bogus", "--", "true"], "sing submit", "no such option: --bogus"),
        (["ps", "extra"], "sing ps", "got unexpected extra argument"),
        (["show", "abc"], "sing show", "invalid value for 'ID': 'abc' is not a valid int range"),
        (["show"], "sing show", "missing argument 'ID'"),
        (["bogus"], "sing", "no such command 'bogus'"),
    ],
)
def test_a_usage_error_is_one_line_with_where_to_find_help(args: list[str], command: str, said: str) -> None:
    """Click's usage errors took four lines (usage, hint, a blank, the error), unlike every other
    error of `sing`, and named the program after however it was started."""
    result = run_sing(args, socket_path=None)
    assert result.code == 2 and result.out == "", result
    assert result.err.count("\n") == 1 and result.err.startswith(f"sing: {said}"), result.err
    assert result.err.endswith(f"; see `{command} -h`\n"), result.err


@pytest.mark.parametrize(
    "args",
    [
        ["submit", "--tier", "", "--", "true"],
        ["submit", "--name", "", "--", "true"],
        ["submit", "--cwd", "", "--", "true"],
        ["ps", "--user", ""],
        ["ps", "--socket", ""],
        ["migrate", "1", "--to", ""],
        ["cluster", "init", "--cluster", ""],
        ["cluster", "init", "--name", ""],
        ["cluster", "join", "", "--token", "abcdef.0123456789abcdef", "--ca-hash", "sha256:00"],
    ],
)
def test_an_empty_option_value_is_a_usage_error(args: list[str], tmp_path: Path) -> None:
    """An empty value (often an unset shell variable) was taken for the option left out: `--tier ""`
    queued a standard job, `--cwd ""` ran it in the current folder, `--user ""` listed everyone's."""
    result = run_sing(args, socket_path=tmp_path / "absent.sock")
    assert result.code == 2, result
    assert "must not be empty" in result.err and result.err.count("\n") == 1, result.err


def test_show_says_how_many_devices_a_job_holds_and_its_range() -> None:
    """What a Slurm or kubectl user expects: the devices held now, then the elastic range (not the
    size asked at submission), which ones, and for a job holding none, what it waits for."""

    def shown(**fields: Any) -> str:
        text = output.job_detail_text(pb.JobDetail(job=pb.Job(id=7, ranks=4, **fields)))
        return next(line for line in text.splitlines() if line.startswith("Devices:"))

    elastic: dict[str, Any] = {"gpus": 4, "min_gpus": 1, "max_gpus": 4}
    assert shown(state="RUNNING", devices=[2, 3], **elastic) == (
        "Devices:    2 (elastic 1-4; 4 ranks share them): 2,3"
    )
    assert shown(state="RUNNING", devices=[0, 1, 2, 3], **elastic) == "Devices:    4 (elastic 1-4): 0,1,2,3"
    assert shown(state="RUNNING", devices=[0, 1, 2, 3], gpus=4) == "Devices:    4: 0,1,2,3"
    assert shown(state="PREEMPTED", **elastic) == "Devices:    none held (waits for 4; elastic 1-4)"
    assert shown(state="COMPLETED", gpus=2) == "Devices:    none held (ran on 2; 4 ranks share them)"
    assert output.gpus_cell(pb.Job(state="RUNNING", devices=[2, 3], **elastic)) == "2 (1-4)"


def test_show_and_checkpoint_print_each_checkpoints_pause() -> None:
    checkpoints = [
        pb.CheckpointInfo(seq=1, created_at=1.0, bytes=1 << 30, complete=True, pause_seconds=0.614,
                          complete_seconds=3.5, precopied_bytes=1 << 30, paused_bytes=51_200),
        pb.CheckpointInfo(seq=2, created_at=2.0, bytes=1 << 30, complete=True, pause_seconds=1.25,
                          complete_seconds=1.25, stopped=True, paused_bytes=1 << 30),
        pb.CheckpointInfo(seq=3),
    ]  # fmt: skip
    detail = pb.JobDetail(job=pb.Job(id=7, checkpoints=2), checkpoint_list=checkpoints)
    narrow = [line.split() for line in output.job_detail_text(detail).splitlines()]
    wide = [line.split() for line in output.job_detail_text(detail, wide=True).splitlines()]
    assert ["CHECKPOINT", "TAKEN", "SIZE", "PAUSE", "COMPLETE", "AFTER"] in narrow
    assert [c[3:] for c in narrow if c[:1] in (["1"], ["2"])] == [
        ["1.0G", "0.61s", "3.50s"],
        ["1.0G", "1.25s", "(stop)", "1.25s"],
    ]
    assert ["3", "-", "-", "incomplete", "-", "-", "-"] in wide
    assert [c[-2:] for c in wide if c[:1] in (["1"], ["2"])] == [["1.0G", "50.0K"], ["0B", "1.0G"]]
    response = pb.CheckpointResponse(job=pb.Job(id=7), checkpoint=checkpoints[0], pause_seconds=0.614)
    assert output.checkpoint_text(response) == (
        "job 7: checkpoint 1, 1.0G, paused 0.61s, complete after 3.50s "
        "(device state: 1.0G pre-copied, 50.0K copied in the pause)"
    )
    assert output.checkpoint_dict(checkpoints[1])["stopped"] is True


def test_ps_json_agrees_with_show_json_for_every_job(daemon: Daemon) -> None:
    done = daemon.submit("sh", "-c", "exit 0", options=["--name", "done"])
    failed = daemon.submit("sh", "-c", "exit 3", options=["--name", "failed"])
    assert daemon.sing("wait", str(done)).code == 0 and daemon.sing("wait", str(failed)).code == 3
    running = daemon.submit("sleep", "300", options=["--gpus", "3", "--name", "running", "--priority", "2"])
    daemon.wait_state(running, "RUNNING")
    pending = daemon.submit("sleep", "300", options=["--gpus", "2", "--name", "pending"])
    held = daemon.submit("sleep", "300", options=["--gpus", "2", "--name", "held"])
    cancelled = daemon.submit("sleep", "300", options=["--gpus", "2", "--name", "cancelled"])
    assert (
        daemon.sing("suspend", str(held)).out
        == f"job {held} suspended; `sing resume {held}` queues it again\n"
    )
    assert daemon.sing("cancel", str(cancelled)).code == 0
    wait_until(lambda: daemon.job(pending)["pending_reason"])

    listed = daemon.sing("ps", "-a", "-o", "json")
    assert listed.code == 0, listed.err
    jobs = listed.json()
    states = {job["id"]: job["state"] for job in jobs}
    assert states == {
        done: "COMPLETED", failed: "FAILED", running: "RUNNING",
        pending: "PENDING", held: "SUSPENDED", cancelled: "CANCELLED",
    }  # fmt: skip
    for job in jobs:
        shown = daemon.job(job["id"])
        assert set(job) <= set(shown), "show has everything ps has"
        for key, value in job.items():
            if job["state"] == "RUNNING" and key in LIVE_USAGE:
                continue
            assert shown[key] == value, f"job {job['id']} ({job['state']}): {key}"
    assert [j["id"] for j in daemon.sing("ps", "-o", "json").json()] == [running, pending, held]


def test_read_commands_take_output_and_header_flags(daemon: Daemon) -> None:
    job = daemon.submit("sleep", "300", options=["--name", "one"])
    daemon.wait_state(job, "RUNNING")
    narrow = daemon.sing("ps").out.splitlines()
    wide = daemon.sing("ps", "-o", "wide").out.splitlines()
    assert len(wide[0].split()) > len(narrow[0].split())
    assert "CKPT-AGE" in wide[0] and "CKPT-PAUSE" in wide[0]
    headless = daemon.sing("ps", "--no-header").out.splitlines()
    assert [row.split()[:6] for row in headless] == [row.split()[:6] for row in narrow[1:]]
    assert daemon.sing("ps", "-o", "table").out.splitlines()[0] == narrow[0]

    devices = daemon.sing("devices", "-o", "wide").out.splitlines()
    assert devices[0].split()[-3:] == ["UUID", "PROXY", "SESSIONS"]
    assert len(daemon.sing("devices", "--no-header").out.splitlines()) == 4
    listed = daemon.sing("devices", "-o", "json").json()
    held = [d for d in listed if d["jobs"] == [job]]
    assert len(held) == 1 and held[0]["proxy"] in ("starting", "up"), "its server, bound at once"

    def server_up() -> list[dict[str, Any]]:
        nonlocal listed
        listed = daemon.sing("devices", "-o", "json").json()
        return [d for d in listed if d["jobs"] == [job] and d["proxy"] == "up"]

    held = wait_until(server_up)
    assert held[0]["sessions"] == [], "a server, unused"
    assert all(d["proxy"] == "idle" and d["sessions"] == [] for d in listed if d not in held)

    shown = daemon.sing("show", str(job)).out
    assert "  TIME" in shown and "  TIME" not in daemon.sing("show", "--no-header", str(job)).out
    assert daemon.sing("show", "-o", "json", str(job)).json()["id"] == job

    assert daemon.sing("wait", "-o", "json", str(daemon.submit("true"))).json()["state"] == "COMPLETED"
    for args in (["ps", "-o", "yaml"], ["devices", "-o", "name"], ["show", str(job), "-o", "xml"]):
        bad = daemon.sing(*args)
        assert bad.code == 2 and bad.out == "" and bad.err.count("\n") == 1 and "-o must be" in bad.err


def test_doctor_json(daemon: Daemon) -> None:
    result = daemon.sing("doctor", "-o", "json")
    found = {check["check"]: check for check in result.json()}
    assert {"socket", "daemon", "identity", "devices", "nvml", "criu", "isolation"} <= set(found)
    assert found["daemon"]["status"] == "ok" and __version__ in found["daemon"]["detail"]
    if found["criu"]["status"] == "ok" and "system mode" in found["daemon"]["detail"]:
        assert found["restore guard"] == {
            "check": "restore guard",
            "status": "ok",
            "detail": "CRIU restores other users' jobs with their rights",
        }
    assert result.code == (1 if any(c["status"] == "FAIL" for c in found.values()) else 0)


def test_config_file(daemon: Daemon, tmp_path: Path) -> None:
    config = tmp_path / "singularity" / "sing.toml"
    config.parent.mkdir()
    config.write_text(f'socket = "{daemon.socket}"\noutput = "wide"\n')
    env = {"SING_SOCKET": "", "XDG_CONFIG_HOME": str(tmp_path)}
    job = daemon.submit("sleep", "300")
    daemon.wait_state(job, "RUNNING")
    wide = run_sing(["ps"], socket_path=None, env=env)
    assert wide.code == 0, wide.err
    assert "CKPT-AGE" in wide.out.splitlines()[0], "the socket and the default output come from the file"
    assert "CKPT-AGE" not in run_sing(["ps", "-o", "table"], socket_path=None, env=env).out
    assert run_sing(["devices"], socket_path=None, env=env).out.splitlines()[0].endswith("SESSIONS")

    config.write_text(f'socket = "{daemon.socket}"\nno_header = true\n')
    assert run_sing(["ps"], socket_path=None, env=env).out.split()[0] == str(job)
    assert run_sing(["ps", "--header"], socket_path=None, env=env).out.startswith("ID")

    config.write_text('output = "yaml"\n')
    bad = run_sing(["ps"], socket_path=None, env=env)
    assert (
        bad.code == 2 and bad.err == f"sing: {config}: output must be one of table, wide, json, not 'yaml'\n"
    )
    explicit = tmp_path / "other.toml"
    explicit.write_text("[oops\n")
    bad = run_sing(["ps"], socket_path=None, env={**env, "SING_CLI_CONFIG": str(explicit)})
    assert bad.code == 2 and bad.err.startswith(f"sing: {explicit}: not valid TOML")


def test_config_settings_are_checked() -> None:
    path = Path("sing.toml")
    assert parse_settings(path, "") == CliSettings(path=path)
    parsed = parse_settings(path, 'socket = "/s"\noutput = "json"\nno_header = true\nrefresh_seconds = 2')
    assert parsed == CliSettings(path=path, socket="/s", output="json", no_header=True, refresh_seconds=2.0)
    for text, message in [
        ("sockets = 1", "unknown setting 'sockets'"),
        ("no_header = 1", "no_header must be a bool"),
        ("refresh_seconds = true", "refresh_seconds must be a float"),
        ("refresh_seconds = 0.01", "at least 0.1"),
        ('socket = ["/s"]', "socket must be a str"),
    ]:
        with pytest.raises(CliError, match=message):
            parse_settings(path, text)


def test_top_needs_a_terminal(daemon: Daemon) -> None:
    result = daemon.sing("top")
    assert result.code == 2 and "needs a terminal" in result.err


def test_top_without_a_daemon_says_so_and_exits_3(tmp_path: Path) -> None:
    """On a terminal with no daemon it opened its full-screen view and waited; every other command
    says the daemon cannot be reached and exits 3."""
    main, terminal = pty.openpty()
    env = {**os.environ, "SING_SOCKET": str(tmp_path / "absent.sock")}
    top = subprocess.Popen([SING, "top"], stdin=terminal, stdout=terminal, stderr=subprocess.PIPE, env=env)
    os.close(terminal)
    try:
        _, err = top.communicate(timeout=30)
    finally:
        os.close(main)
    assert top.returncode == 3 and b"cannot reach singularityd" in err, err


def read_until(fd: int, wanted: bytes, timeout: float = 30.0) -> bytes:
    """Read a pty until `wanted` shows up (or it closes); everything read."""
    seen = b""
    deadline = time.monotonic() + timeout
    while wanted not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    return seen


def test_progress_on_a_terminal_only(daemon: Daemon) -> None:
    release = daemon.root / "release"
    job = daemon.submit("sh", "-c", f"while [ ! -e {release} ]; do sleep 0.05; done")
    daemon.wait_state(job, "RUNNING")
    main, terminal = pty.openpty()
    waiter = subprocess.Popen(
        [SING, "wait", str(job)], stdout=subprocess.PIPE, stderr=terminal, env=sing_env(daemon)
    )
    os.close(terminal)
    try:
        assert f"waiting for job {job}".encode() in read_until(main, b"waiting for job")
        piped = subprocess.Popen(
            [SING, "wait", str(job)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=sing_env(daemon)
        )
        release.touch()
        rest = read_until(main, b"\x00", timeout=30)
        assert waiter.wait(30) == 0
        assert rest.endswith(b"\r\x1b[K"), "the line is erased at the end"
        assert waiter.stdout is not None and waiter.stdout.read() == b""
        assert piped.communicate(timeout=30) == (b"", b""), "nothing on stderr when it is not a terminal"
    finally:
        os.close(main)


def test_resume_wait_returns_once_running(daemon: Daemon) -> None:
    blocker = daemon.submit("sleep", "300", options=["--gpus", "4"])
    daemon.wait_state(blocker, "RUNNING")
    held = daemon.submit("sleep", "300")
    assert daemon.sing("suspend", str(held)).code == 0
    resumer = subprocess.Popen([SING, "resume", "--wait", str(held)], env=sing_env(daemon))
    wait_until(lambda: daemon.job(held)["state"] == "PENDING")
    assert resumer.poll() is None, "still queued behind the blocker"
    assert daemon.sing("cancel", str(blocker)).code == 0
    assert resumer.wait(60) == 0
    job = daemon.job(held)
    assert job["state"] == "RUNNING" and not job["starting"]


def test_logs_follow_ends_with_one_line_when_the_daemon_stays_away(tmp_path: Path) -> None:
    """A follower of a daemon stopped for good (not restarted) waited for ever, saying nothing."""
    follower = LogFollower(tmp_path / "gone.sock", 7, retry_seconds=0.05, give_up_seconds=0.5)
    follower._first_contact = lambda: None  # type: ignore[method-assign]
    began = time.monotonic()
    with pytest.raises(CliError) as ended:
        list(follower)
    assert ended.value.code == 3 and time.monotonic() - began < 10
    assert ended.value.message == (
        f"singularityd at {tmp_path / 'gone.sock'} stopped and has not come back for 0.5s; "
        "stopped following job 7"
    )


def test_logs_follow_survives_a_daemon_restart(daemon: Daemon) -> None:
    gates = [daemon.root / "gate-1", daemon.root / "gate-2"]
    script = "echo line 1; " + "; ".join(
        f"while [ ! -e {gate} ]; do sleep 0.05; done; echo line {n}" for n, gate in enumerate(gates, start=2)
    )
    job = daemon.submit("sh", "-c", script)
    follower = subprocess.Popen(
        [SING, "logs", "-f", str(job)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=sing_env(daemon)
    )
    assert follower.stdout is not None
    assert follower.stdout.readline() == b"line 1\n"
    daemon.stop()
    gates[0].touch()
    daemon.start()
    assert follower.stdout.readline() == b"line 2\n"
    gates[1].touch()
    out, err = follower.communicate(timeout=60)
    assert (follower.returncode, out, err) == (0, b"line 3\n", b"")


def restores(daemon: Daemon, job: int) -> int:
    """How many times the job was restored from a checkpoint."""
    return sum(e["reason"].startswith("restored from checkpoint") for e in daemon.job(job)["events"])


class Collector:
    """Reads a follower's stdout in the background, line by line."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.lines: list[str] = []
        assert process.stdout is not None
        self.stream = process.stdout
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        """Collect lines until the stream ends."""
        for line in self.stream:
            self.lines.append(line.decode().rstrip("\n"))


@requires_root
@pytest.mark.slow
def test_logs_follow_through_preemption_and_resumption(daemon_root: Path) -> None:
    """A counter followed with `logs -f` while it is preempted, restored, suspended and resumed."""
    with running_daemon(daemon_root, virtual_devices=2) as daemon:
        if "checkpoints unavailable" in daemon.sing("doctor").out:
            pytest.fail("CRIU must work for this test (run scripts/setup)")
        release = daemon.root / "release"
        job = submit_counter(daemon, release)
        follower = subprocess.Popen(
            [SING, "logs", "-f", str(job)], stdout=subprocess.PIPE, env=sing_env(daemon)
        )
        collected = Collector(follower)
        wait_until(lambda: len(collected.lines) >= 20)

        preempted = daemon.sing("preempt", str(job))
        assert preempted.code == 0 and preempted.out.startswith(f"job {job} preempted at checkpoint 1 ("), (
            preempted
        )
        wait_until(lambda: restores(daemon, job) == 1, timeout=120)
        seen = len(collected.lines)
        wait_until(lambda: len(collected.lines) > seen + 20)

        suspended = daemon.sing("suspend", str(job))
        assert suspended.code == 0 and f"`sing resume {job}` queues it again" in suspended.out, suspended
        assert daemon.job(job)["state"] == "SUSPENDED"
        seen = len(collected.lines)
        assert daemon.sing("resume", "--wait", str(job), timeout=120).code == 0
        wait_until(lambda: len(collected.lines) > seen + 20)

        release.touch()
        assert follower.wait(60) == 0
        collected.thread.join(10)
        counted, last = collected.lines[:-1], collected.lines[-1]
        assert last == "end"
        assert counted == [str(n) for n in range(len(counted))], "no line lost or repeated"
        assert daemon.sing("logs", str(job)).out.splitlines() == collected.lines
        assert restores(daemon, job) == 2
