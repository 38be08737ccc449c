"""The real daemon on a real socket, driven by the real `sing` binary."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from tests.helpers import SING, Daemon, PrintedLines, running_daemon, wait_until


def test_submit_ps_show_logs_wait(daemon: Daemon) -> None:
    release = daemon.root / "release"
    job_id = daemon.submit(
        "sh", "-c",
        f'echo "rank=$RANK world=$WORLD_SIZE devices=$SING_DEVICES x=$X"; '
        f"while [ ! -e {release} ]; do sleep 0.05; done; echo done; exit 3",
        options=["--name", "demo", "--gpus", "2", "--priority", "4", "--env", "X=42"],
    )  # fmt: skip
    running = daemon.wait_state(job_id, "RUNNING")
    assert running["devices"] == [0, 1]
    assert running["name"] == "demo" and running["priority"] == 4 and running["gpus"] == 2

    table = daemon.sing("ps")
    assert table.code == 0
    header, *rows = table.out.splitlines()
    assert header.split() == ["ID", "NAME", "USER", "STATE", "TIER", "PRI", "GPUS", "TIME", "DEVICES(REASON)"]
    assert rows[0].split()[:7] == [str(job_id), "demo", "root", "RUNNING", "standard", "4", "2"]
    assert rows[0].split()[-1] == "0,1"
    wide = daemon.sing("ps", "-o", "wide", "--no-header")
    assert wide.code == 0 and wide.out.split()[0] == str(job_id) and "RSS" not in wide.out
    listed = daemon.sing("ps", "-o", "json").json()
    assert [j["id"] for j in listed] == [job_id] and listed[0]["state"] == "RUNNING"
    assert listed[0]["rss_bytes"] > 0

    release.touch()
    waited = daemon.sing("wait", str(job_id))
    assert waited.code == 3, waited.err
    assert daemon.sing("ps", "--no-header").out == ""
    ended = daemon.sing("ps", "-a", "-o", "json").json()
    assert ended[0]["state"] == "FAILED" and ended[0]["exit_code"] == 3

    logs = daemon.sing("logs", str(job_id))  # one rank on two devices: no torchrun variables
    assert logs.out == "rank= world= devices=0,1 x=42\ndone\n"
    assert daemon.sing("logs", "--tail", "1", str(job_id)).out == "done\n"
    assert daemon.sing("logs", "--tail", "0", str(job_id)).out == ""

    shown = daemon.sing("show", str(job_id))
    assert shown.code == 0
    assert "State:      FAILED" in shown.out and "exited with code 3" in shown.out
    detail = daemon.job(job_id)
    assert [e["to_state"] for e in detail["events"]] == ["PENDING", "RUNNING", "FAILED"]
    assert all(e["reason"] for e in detail["events"])
    assert detail["env"]["X"] == "42"


def test_logs_follow_streams_until_the_job_ends(daemon: Daemon) -> None:
    release = daemon.root / "release"
    wait = f"while [ ! -e {release} ]; do sleep 0.05; done"
    script = f"echo line 1; {wait}; echo line 2; echo line 3; echo line 4"
    job_id = daemon.submit("sh", "-c", script)
    daemon.wait_state(job_id, "RUNNING")
    follower = subprocess.Popen(
        [SING, "logs", "-f", str(job_id)], stdout=subprocess.PIPE, text=True, env=daemon_env(daemon)
    )
    assert follower.stdout is not None
    assert follower.stdout.readline() == "line 1\n"
    assert daemon.job(job_id)["state"] == "RUNNING", "the first line arrives while the job still runs"
    release.touch()
    assert follower.stdout.read() == "line 2\nline 3\nline 4\n"
    assert follower.wait(30) == 0


def test_ctrl_c_of_a_follower_exits_130_without_a_traceback(daemon: Daemon) -> None:
    """`sing logs -f` and `sing ps -w` stopped with Ctrl-C exit as a shell reports SIGINT (130, as
    `tail -f` and `kubectl logs -f` do), not 0 as if the job had ended."""
    job_id = daemon.submit("sh", "-c", "echo started; sleep 300")
    daemon.wait_state(job_id, "RUNNING")
    for command in (["logs", "-f", str(job_id)], ["ps", "-w"]):
        follower = subprocess.Popen(
            [SING, *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=daemon_env(daemon),
        )
        assert follower.stdout is not None and follower.stdout.readline()
        follower.send_signal(signal.SIGINT)
        _, err = follower.communicate(timeout=30)
        assert follower.returncode == 130, (command, follower.returncode, err)
        assert "Traceback" not in err
    daemon.sing("cancel", str(job_id))


def test_numbers_beyond_what_the_api_carries_are_usage_errors(daemon: Daemon) -> None:
    """A job id or a count too large for the wire (int64, int32) was a traceback from the encoder."""
    huge = "99999999999999999999"
    for command in (
        ["show", huge],
        ["cancel", "1", huge],
        ["logs", "--tail", huge, "1"],
        ["submit", "--gpus", huge, "--", "true"],
    ):
        result = daemon.sing(*command)
        assert result.code == 2 and "is not in the range" in result.err, (command, result.err)
        assert "Traceback" not in result.err


def daemon_env(daemon: Daemon) -> dict[str, str]:
    return {**os.environ, "SING_SOCKET": str(daemon.socket)}


def test_submit_wait_passes_exit_code_and_signals(daemon: Daemon) -> None:
    assert daemon.sing("submit", "--wait", "--", "sh", "-c", "exit 0").code == 0
    assert daemon.sing("submit", "--wait", "--", "sh", "-c", "exit 42").code == 42
    killed = daemon.sing("submit", "-W", "--", "sh", "-c", "kill -9 $$")
    assert killed.code == 128 + 9


def test_cancel_running_and_queued(daemon: Daemon) -> None:
    running = daemon.submit("sleep", "300", options=["--gpus", "4"])
    daemon.wait_state(running, "RUNNING")
    queued = daemon.submit("sleep", "300")
    job = daemon.wait_state(queued, "PENDING")
    assert wait_until(lambda: daemon.job(queued)["pending_reason"]) == "Resources: needs 1 device, 0 free"
    assert "Resources: needs 1 device, 0 free" in daemon.sing("ps").out
    assert job["state"] == "PENDING"

    result = daemon.sing("cancel", str(queued), str(running))
    assert result.code == 0, result.err
    assert daemon.job(queued)["state"] == "CANCELLED"
    ended = daemon.wait_state(running, "CANCELLED", timeout=20)
    assert ended["signal"] == 15 or ended["exit_code"] is not None
    assert [e["to_state"] for e in ended["events"]][-1] == "CANCELLED"
    assert daemon.sing("wait", str(running)).code == 128 + 15
    again = daemon.sing("cancel", str(running))
    assert again.code == 6 and "already CANCELLED" in again.err


def test_cancel_escalates_to_sigkill(daemon_root: Path) -> None:
    with running_daemon(daemon_root, config={"kill_grace_seconds": 1.0}) as daemon:
        job_id = daemon.submit(
            "python3",
            "-c",
            "import signal, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('ready', flush=True)\n"
            "time.sleep(300)",
        )
        daemon.wait_state(job_id, "RUNNING")
        wait_until(lambda: daemon.sing("logs", str(job_id)).out == "ready\n")
        started = time.monotonic()
        assert daemon.sing("cancel", str(job_id)).code == 0
        ended = daemon.wait_state(job_id, "CANCELLED", timeout=30)
        assert ended["signal"] == 9
        assert time.monotonic() - started < 10


def test_devices(daemon: Daemon) -> None:
    table = daemon.sing("devices")
    assert table.code == 0
    assert table.out.splitlines()[0].split() == ["INDEX", "KIND", "NAME", "MEMORY", "UTIL", "JOBS"]
    assert len(table.out.splitlines()) == 5
    job_id = daemon.submit("sleep", "300", options=["--gpus", "2"])
    daemon.wait_state(job_id, "RUNNING")
    devices = daemon.sing("devices", "-o", "json").json()
    assert [d["index"] for d in devices] == [0, 1, 2, 3]
    assert {d["kind"] for d in devices} == {"virtual"}
    assert devices[0]["memory_total"] == 16 * 1024**3
    assert [d["jobs"] for d in devices] == [[job_id], [job_id], [], []]


def test_ranks_get_torchrun_environment(daemon: Daemon) -> None:
    job_id = daemon.submit(
        "sh", "-c", 'echo "$RANK/$WORLD_SIZE/$LOCAL_RANK $MASTER_ADDR:$MASTER_PORT"', options=["--ranks", "3"]
    )
    assert daemon.sing("wait", str(job_id)).code == 0
    outputs = [daemon.sing("logs", "--rank", str(r), str(job_id)).out for r in range(3)]
    port = outputs[0].split(":")[1].strip()
    assert outputs == [f"{r}/3/{r} 127.0.0.1:{port}\n" for r in range(3)]
    bad = daemon.sing("logs", "--rank", "3", str(job_id))
    assert bad.code == 2 and "ranks 0 to 2" in bad.err


def test_failed_rank_stops_the_others(daemon: Daemon) -> None:
    job_id = daemon.submit(
        "sh", "-c", 'if [ "$RANK" = 1 ]; then exit 5; fi; sleep 300', options=["--ranks", "2"]
    )
    assert daemon.sing("wait", str(job_id), timeout=40).code == 5
    shown = daemon.job(job_id)
    assert shown["state"] == "FAILED"
    assert shown["events"][-1]["reason"] == "rank 1 exited with code 5; the other ranks were stopped"


def test_command_not_found_is_a_clear_failure(daemon: Daemon) -> None:
    job_id = daemon.submit("no-such-program-xyz")
    assert daemon.sing("wait", str(job_id)).code == 127
    job = daemon.job(job_id)
    assert job["state"] == "FAILED"
    assert job["reason"] == "command not found: no-such-program-xyz"


def gate(release: Path) -> list[str]:
    """A job command that runs until the file `release` exists."""
    return ["sh", "-c", f"while [ ! -e {release} ]; do sleep 0.05; done"]


def states_of(job_id: int, lines: list[str]) -> list[str]:
    """The states a `sing ps -w` printed for one job, in order."""
    return [line.split()[3] for line in lines if line.split() and line.split()[0] == str(job_id)]


def test_watch_prints_changes(daemon: Daemon) -> None:
    blocker_release, job_release = daemon.root / "release-blocker", daemon.root / "release-job"
    blocker = daemon.submit(*gate(blocker_release), options=["--gpus", "4"])
    daemon.wait_state(blocker, "RUNNING")
    watcher = subprocess.Popen([SING, "ps", "-w"], stdout=subprocess.PIPE, text=True, env=daemon_env(daemon))
    try:
        printed = PrintedLines(watcher)
        printed.wait_for(lambda lines: states_of(blocker, lines) == ["RUNNING"])
        assert printed.lines[0].split()[:4] == ["ID", "NAME", "USER", "STATE"], "the listing comes first"
        job_id = daemon.submit(*gate(job_release))
        printed.wait_for(lambda lines: "PENDING" in states_of(job_id, lines))
        blocker_release.touch()
        printed.wait_for(lambda lines: "RUNNING" in states_of(job_id, lines))
        job_release.touch()
        printed.wait_for(lambda lines: "COMPLETED" in states_of(job_id, lines))
        states = states_of(job_id, printed.lines)
        changes = [state for i, state in enumerate(states) if i == 0 or states[i - 1] != state]
        assert changes == ["PENDING", "RUNNING", "COMPLETED"], states
        assert states_of(blocker, printed.lines)[-1] == "COMPLETED"
        assert sum(line.split()[0] == "ID" for line in printed.lines) == 1, "changes come without a header"
    finally:
        watcher.terminate()
        watcher.wait(10)


def test_shell_completion_is_offered() -> None:
    result = subprocess.run([SING, "--show-completion", "bash"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    assert "complete" in result.stdout


def test_spawning_many_jobs_while_rpcs_are_in_flight(daemon: Daemon) -> None:
    """The daemon forks launchers while serving gRPC: stress both at once, nothing is lost."""
    from concurrent.futures import ThreadPoolExecutor

    watcher = subprocess.Popen(
        [SING, "ps", "-w", "-a", "--no-header"], stdout=subprocess.PIPE, text=True, env=daemon_env(daemon)
    )
    try:
        printed = PrintedLines(watcher)
        with ThreadPoolExecutor(max_workers=8) as pool:
            codes = list(
                pool.map(
                    lambda n: daemon.sing("submit", "--wait", "--", "sh", "-c", f"exit {n % 7}").code,
                    range(24),
                )
            )
            listed = list(pool.map(lambda _: daemon.sing("ps", "-a", "-o", "json").code, range(8)))
        assert codes == [n % 7 for n in range(24)]
        assert listed == [0] * 8
        jobs = daemon.sing("ps", "-a", "-o", "json").json()
        assert len(jobs) == 24
        assert all(j["state"] == ("COMPLETED" if j["exit_code"] == 0 else "FAILED") for j in jobs)
        final = {job["id"]: job["state"] for job in jobs}

        def watched_to_the_end(lines: list[str]) -> bool:
            return all(states_of(job_id, lines)[-1:] == [state] for job_id, state in final.items())

        printed.wait_for(watched_to_the_end)
    finally:
        watcher.terminate()
        watcher.wait(10)
