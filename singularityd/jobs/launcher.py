"""Start one job: a supervisor (the job's init) that runs the ranks as the submitting user.

Run by the daemon (singularityd.jobs.launch) as `python -S launcher.py SPEC.json`; it imports
only the standard library so it starts fast and never depends on the daemon's packages. As root
it puts the job in a new PID namespace (so a CRIU restore never needs the original PIDs), forks
the supervisor, prints the supervisor's host PID and exits: the supervisor outlives the daemon,
and records the job's exit status in a file, so a restarted daemon can re-adopt the job or learn
how it ended.

The supervisor itself stays root (CRIU can only restore a PID namespace whose init is root, and
the status file lives where the user cannot tamper with it); every rank drops to the user
before it runs anything, and enters its working directory only as that user.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

CLONE_NEWPID = 0x20000000
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
EXIT_LAUNCH_ERROR = 127

_libc = ctypes.CDLL(None, use_errno=True)


def _unshare_pid_namespace() -> None:
    if _libc.unshare(CLONE_NEWPID) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unshare(CLONE_NEWPID): {os.strerror(errno)}")


def _rank_setup(cwd: str) -> Any:
    """What each rank runs after dropping to the user and before exec.

    The kernel kills the rank if its supervisor dies (set after the uid change, which would
    clear it), and the working directory is entered with the user's own permissions.
    """

    def setup() -> None:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        os.chdir(cwd)

    return setup


def _check_cwd_as_user(spec: dict[str, Any]) -> str:
    """Whether the user may enter the working directory; an error message or ''."""
    if os.geteuid() != 0:
        try:
            os.chdir(spec["cwd"])
        except OSError as error:
            return f"cannot enter working directory {spec['cwd']}: {error.strerror}"
        return ""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.setgroups(spec["groups"])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])
            os.chdir(spec["cwd"])
        except OSError as error:
            code = error.errno or 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    errno = os.waitstatus_to_exitcode(status)
    if errno == 0:
        return ""
    who = spec.get("user", spec["uid"])
    return f"cannot enter working directory {spec['cwd']} as {who}: {os.strerror(errno)}"


def _open_log(path: str, uid: int, gid: int) -> int:
    """Open a log for appending, owned by the job's user and private to them."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    if os.geteuid() == 0:
        os.fchown(fd, uid, gid)
    return fd


def _write_status(path: str, status: dict[str, Any]) -> None:
    """Write the job's final status atomically (temporary file, then rename)."""
    temporary = f"{path}.tmp"
    with open(temporary, "w") as handle:
        json.dump(status, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


class Supervisor:
    """The job's init: starts every rank, forwards termination, reaps, records the outcome."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.ranks: dict[int, int] = {}
        self.outcomes: dict[int, tuple[int | None, int | None]] = {}
        self.cpu_seconds = 0.0
        self.max_rss_bytes = 0
        self.terminating = False
        self.first_failure: tuple[int | None, int | None] | None = None

    def terminate_ranks(self, sig: int = signal.SIGTERM) -> None:
        """Signal every live rank's process group; on SIGTERM arm the SIGKILL deadline."""
        for pid in self.ranks:
            if pid not in self.outcomes:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, sig)
        if sig == signal.SIGTERM and not self.terminating:
            self.terminating = True
            grace = float(self.spec.get("kill_grace_seconds", 10.0))
            signal.setitimer(signal.ITIMER_REAL, max(grace, 0.01))

    def _on_term(self, signum: int, frame: object) -> None:
        self.terminate_ranks(signal.SIGTERM)

    def _on_deadline(self, signum: int, frame: object) -> None:
        self.terminate_ranks(signal.SIGKILL)

    def start_ranks(self) -> None:
        """Start each rank in its own process group, as the job's user, with its environment."""
        devnull = os.open(os.devnull, os.O_RDONLY)
        for rank, env in enumerate(self.spec["rank_envs"]):
            log_fd = _open_log(self.spec["rank_logs"][rank], self.spec["uid"], self.spec["gid"])
            identity: dict[str, Any] = {}
            if os.geteuid() == 0:
                identity = {
                    "user": self.spec["uid"],
                    "group": self.spec["gid"],
                    "extra_groups": self.spec["groups"],
                }
            try:
                process = subprocess.Popen(
                    self.spec["command"],
                    env=env,
                    stdin=devnull,
                    stdout=log_fd,
                    stderr=log_fd,
                    process_group=0,
                    preexec_fn=_rank_setup(self.spec["cwd"]),
                    close_fds=True,
                    **identity,
                )
            finally:
                os.close(log_fd)
            self.ranks[process.pid] = rank
            # The Popen object must not reap the rank; the supervisor's wait loop does.
            process.returncode = 0
        os.close(devnull)

    def wait_ranks(self) -> None:
        """Reap children (ranks and any orphans) until every rank has ended."""
        while len(self.outcomes) < len(self.ranks):
            try:
                pid, status, usage = os.wait4(-1, 0)
            except ChildProcessError:
                break
            self.cpu_seconds += usage.ru_utime + usage.ru_stime
            self.max_rss_bytes = max(self.max_rss_bytes, usage.ru_maxrss * 1024)
            if pid not in self.ranks:
                continue
            if os.WIFSIGNALED(status):
                outcome: tuple[int | None, int | None] = (None, os.WTERMSIG(status))
            else:
                outcome = (os.waitstatus_to_exitcode(status), None)
            self.outcomes[pid] = outcome
            if outcome != (0, None) and self.first_failure is None:
                self.first_failure = outcome
                self.terminate_ranks(signal.SIGTERM)

    def run(self) -> int:
        """Start the ranks, wait for them, write the status file; returns the exit code."""
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_term)
        signal.signal(signal.SIGALRM, self._on_deadline)
        status: dict[str, Any] = {}
        cwd_problem = _check_cwd_as_user(self.spec)
        try:
            if cwd_problem:
                status = {"exit_code": 126, "signal": None, "error": cwd_problem}
            else:
                self.start_ranks()
        except FileNotFoundError as error:
            message = f"command not found: {error.filename or self.spec['command'][0]}"
            self.terminate_ranks(signal.SIGKILL)
            status = {"exit_code": EXIT_LAUNCH_ERROR, "signal": None, "error": message}
        except PermissionError as error:
            message = f"permission denied: {error.filename or self.spec['command'][0]}"
            self.terminate_ranks(signal.SIGKILL)
            status = {"exit_code": 126, "signal": None, "error": message}
        except (OSError, subprocess.SubprocessError) as error:
            self.terminate_ranks(signal.SIGKILL)
            status = {"exit_code": EXIT_LAUNCH_ERROR, "signal": None, "error": f"cannot start: {error}"}
        self.wait_ranks()
        if not status:
            code, sig = self.first_failure or (0, None)
            status = {"exit_code": code, "signal": sig, "error": ""}
        status["ranks"] = [
            {"rank": self.ranks[pid], "exit_code": code, "signal": sig}
            for pid, (code, sig) in sorted(self.outcomes.items(), key=lambda item: self.ranks[item[0]])
        ]
        status["cpu_seconds"] = self.cpu_seconds
        status["max_rss_bytes"] = self.max_rss_bytes
        status["ended_at"] = time.time()
        _write_status(self.spec["status_path"], status)
        if status["signal"] is not None:
            return 128 + int(status["signal"])
        return int(status["exit_code"] or 0) & 0xFF


def _supervise(spec: dict[str, Any]) -> int:
    """Body of the forked supervisor; returns its exit code."""
    os.setsid()
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    log_fd = _open_log(spec["supervisor_log"], spec["uid"], spec["gid"])
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.closerange(3, 1 << 16)
    return Supervisor(spec).run()


def launch(spec: dict[str, Any]) -> int:
    """Fork the supervisor (in a new PID namespace when asked) and return its host PID."""
    if spec.get("pid_namespace"):
        _unshare_pid_namespace()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _supervise(spec)
        except BaseException as error:
            try:
                _write_status(
                    spec["status_path"],
                    {"exit_code": EXIT_LAUNCH_ERROR, "signal": None, "error": f"supervisor failed: {error}"},
                )
            finally:
                code = EXIT_LAUNCH_ERROR
        finally:
            os._exit(code)
    with open(f"{spec['pid_path']}.tmp", "w") as handle:
        handle.write(f"{pid} {_start_ticks(pid)}\n")
    os.replace(f"{spec['pid_path']}.tmp", spec["pid_path"])
    return pid


def _start_ticks(pid: int) -> int:
    """The process's start time in clock ticks since boot (names it together with the PID)."""
    with open(f"/proc/{pid}/stat", "rb") as handle:
        data = handle.read()
    return int(data[data.rindex(b")") + 2 :].split()[19])


def main() -> None:
    """Read the spec named on the command line, launch, print the supervisor's host PID."""
    with open(sys.argv[1]) as handle:
        spec = json.load(handle)
    try:
        pid = launch(spec)
    except OSError as error:
        print(f"launch failed: {error}", file=sys.stderr)
        sys.exit(1)
    print(pid, flush=True)


if __name__ == "__main__":
    main()
