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

With `user_namespace` in the spec the job also gets a user namespace owned by root, with every
uid and gid mapped to itself, and a mount namespace of its own in which /proc belongs to the
job's PID namespace: root outside then holds every capability over the job's processes, which
lets CRIU checkpoint another user's job where root lacks CAP_SYS_RESOURCE. The order matters to
the kernel and to CRIU (see `launch_in_user_namespace`). `network_namespace` gives the job a
network of its own with only a loopback device. `python -S launcher.py --probe` tries the whole
set-up once and prints what failed, if anything. `--restore-mounts` prepares the mounts CRIU
needs to restore such a job and runs CRIU (see `exec_in_mount_yard`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 0x2
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
STATUS_RESERVE_BYTES = 64 * 1024
"""Room set aside for a job's final status: its ranks' outcomes for a thousand ranks."""
RESERVE_SUFFIX = ".reserve"
EXIT_LAUNCH_ERROR = 127
IDENTITY_MAP = "0 0 4294967295\n"
SUPERVISE_FLAG = "--supervise"
PROBE_FLAG = "--probe"
RESTORE_MOUNTS_FLAG = "--restore-mounts"
YARD_ROOT = "root"

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    """Raise OSError naming the call when a libc call failed."""
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _unshare(flags: int, what: str) -> None:
    """Move this process into new namespaces of the kinds in `flags`."""
    _check(_libc.unshare(flags), f"unshare({what})")


def _setns(fd: int, nstype: int, what: str) -> None:
    """Join the namespace open as `fd` (for a PID namespace: this process's next children do)."""
    _check(_libc.setns(fd, nstype), f"setns({what})")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    """mount(2), raising OSError on failure."""
    _check(
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def _bring_up_loopback() -> None:
    """Set the loopback device of the process's network namespace up (a new one starts down)."""
    layout = "16sH14x"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        current = fcntl.ioctl(probe.fileno(), SIOCGIFFLAGS, struct.pack(layout, b"lo", 0))
        flags = struct.unpack(layout, current)[1]
        fcntl.ioctl(probe.fileno(), SIOCSIFFLAGS, struct.pack(layout, b"lo", flags | IFF_UP))


def _rank_setup(cwd: str) -> Any:
    """What each rank runs after dropping to the user and before exec.

    The kernel kills the rank if its supervisor dies (set after the uid change, which would
    clear it), no program the rank runs gains privileges (setuid and file capabilities are
    ignored, so nothing of the job runs as more than its user, nor leaves another user's memory
    in the user's checkpoint images), and the working directory is entered with the user's own
    permissions.
    """

    def setup() -> None:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
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


def reserve_status(path: str) -> None:
    """Set aside room on disk for the job's final status (a file of zeros beside it, which the
    supervisor overwrites in place), so that a disk full by the time the job ends cannot cost the
    job its exit code; raises OSError when there is no room even now."""
    fd = os.open(f"{path}{RESERVE_SUFFIX}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as handle:
        handle.write(bytes(STATUS_RESERVE_BYTES))
        handle.flush()
        os.fsync(handle.fileno())


def _write_status(path: str, status: dict[str, Any]) -> None:
    """Write the job's final status atomically (into the room reserved for it, else a temporary
    file, then rename)."""
    data = json.dumps(status).encode()
    temporary = f"{path}{RESERVE_SUFFIX}"
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        temporary = f"{path}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.truncate(len(data))
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
        self.first_failed_rank: int | None = None

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
                self.first_failed_rank = self.ranks[pid]
                self.terminate_ranks(signal.SIGTERM)

    def _rank_failure(self) -> str:
        """Which rank of a multi-rank job failed first, and how ('' if none or a single rank)."""
        if self.first_failure is None or self.first_failed_rank is None or len(self.ranks) < 2:
            return ""
        code, sig = self.first_failure
        how = f"was killed by signal {sig}" if sig is not None else f"exited with code {code}"
        return f"rank {self.first_failed_rank} {how}; the other ranks were stopped"

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
            status = {"exit_code": code, "signal": sig, "error": self._rank_failure()}
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
    if spec.get("network_namespace"):
        _bring_up_loopback()
    os.setsid()
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    log_fd = _open_log(spec["supervisor_log"], spec["uid"], spec["gid"])
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.closerange(3, 1 << 16)
    return Supervisor(spec).run()


def _run_supervisor(spec: dict[str, Any]) -> None:
    """Run the supervisor in this process and exit with its code (never returns)."""
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


def _record_pid(spec: dict[str, Any], pid: int, ticks: int) -> None:
    """Write the supervisor's host PID and start time where the daemon looks for them."""
    with open(f"{spec['pid_path']}.tmp", "w") as handle:
        handle.write(f"{pid} {ticks}\n")
    os.replace(f"{spec['pid_path']}.tmp", spec["pid_path"])


def launch(spec: dict[str, Any], spec_path: str = "") -> int:
    """Fork the supervisor (in new namespaces when asked) and return its host PID.

    The supervisor works in /, which every machine has: CRIU restores its working directory by
    path, on this machine or a peer, and its parasite briefly makes a directory there to dump a
    job whose /proc is not its PID namespace's (each rank enters the job's own directory).
    """
    os.chdir("/")
    if spec.get("user_namespace"):
        pid, ticks = launch_in_user_namespace(
            spec, [sys.executable, "-S", os.path.abspath(__file__), SUPERVISE_FLAG, spec_path]
        )
        _record_pid(spec, pid, ticks)
        return pid
    if spec.get("pid_namespace"):
        _unshare(CLONE_NEWPID | (CLONE_NEWNET if spec.get("network_namespace") else 0), "CLONE_NEWPID")
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        _run_supervisor(spec)
    _record_pid(spec, pid, _start_ticks(pid))
    return pid


def _read_exactly(fd: int, size: int) -> bytes:
    """Read `size` bytes from a pipe, or fewer when its writers have all closed it."""
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def launch_in_user_namespace(spec: dict[str, Any], supervisor_argv: list[str]) -> tuple[int, int]:
    """Start the job's init in a user namespace owned by root; return its host PID and start ticks.

    1. This process (root) enters a private copy of the mount namespace, owned by the initial
       user namespace, so that it may replace /proc there.
    2. A helper child creates the user namespace; this process writes its identity uid and gid
       maps (only root outside may map more than one id). The helper then creates the PID (and
       network) namespace and forks the init, which waits; the helper exits.
    3. This process joins the PID namespace and forks a short-lived child that swaps /proc for a
       proc of the job's PID namespace: CRIU's parasite needs a /proc of the init's own PID
       namespace, and mounting it needs root of the initial namespace here (a second proc over
       the first would leave two mounts at /proc, which CRIU's external mounts cannot tell apart).
    4. The init then takes a mount namespace of its own, owned by the job's user namespace (CRIU
       recreates every namespace inside the user namespace, and checks that they belong to it),
       and execs the supervisor, so that even its executable is opened inside that namespace.

    This process's /proc is the job's afterwards: it learns all it needs from /proc before.
    """
    _unshare(CLONE_NEWNS, "CLONE_NEWNS")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    to_parent_r, to_parent_w = os.pipe()
    to_helper_r, to_helper_w = os.pipe()
    go_r, go_w = os.pipe()
    sys.stdout.flush()
    helper = os.fork()
    if helper == 0:
        code = 1
        try:
            os.close(go_w)
            _unshare(CLONE_NEWUSER, "CLONE_NEWUSER")
            os.write(to_parent_w, b"u")
            if _read_exactly(to_helper_r, 1) == b"m":
                flags = CLONE_NEWPID | (CLONE_NEWNET if spec.get("network_namespace") else 0)
                _unshare(flags, "CLONE_NEWPID")
                init = os.fork()
                if init == 0:
                    os.close(to_parent_w)
                    _wait_and_exec_supervisor(go_r, supervisor_argv, spec.get("status_path"))
                os.write(to_parent_w, str(init).encode())
                code = 0
        except BaseException as error:
            os.write(to_parent_w, f"!{error}".encode())
        finally:
            os._exit(code)
    os.close(go_r)
    os.close(to_parent_w)
    init = 0
    try:
        if _read_exactly(to_parent_r, 1) != b"u":
            raise OSError(
                f"cannot create a user namespace: {os.read(to_parent_r, 4096).decode(errors='replace')}"
            )
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{helper}/{name}", "w") as handle:
                handle.write(IDENTITY_MAP)
        os.write(to_helper_w, b"m")
        os.waitpid(helper, 0)
        answer = os.read(to_parent_r, 4096).decode(errors="replace")
        if not answer.isdigit():
            raise OSError(f"cannot create the job's namespaces: {answer.lstrip('!')}")
        init = int(answer)
        ticks = _start_ticks(init)
        _replace_proc_for(init)
        os.write(go_w, b"g")
    except BaseException:
        if init:
            with contextlib.suppress(ProcessLookupError):
                os.kill(init, signal.SIGKILL)
        raise
    finally:
        os.close(go_w)
    return init, ticks


def _wait_and_exec_supervisor(go_fd: int, argv: list[str], status_path: str | None) -> None:
    """In the job's init: wait for the launcher's go, take a mount namespace, exec the supervisor."""
    error: BaseException | str = "the launcher gave up"
    try:
        if _read_exactly(go_fd, 1) == b"g":
            _unshare(CLONE_NEWNS, "CLONE_NEWNS")
            os.execv(argv[0], argv)
    except BaseException as failure:
        error = failure
    finally:
        if status_path:
            with contextlib.suppress(OSError):
                message = f"supervisor failed: {error}"
                _write_status(status_path, {"exit_code": EXIT_LAUNCH_ERROR, "signal": None, "error": message})
        os._exit(EXIT_LAUNCH_ERROR)


def _replace_proc_for(init: int) -> None:
    """Mount a proc of `init`'s PID namespace at /proc in place of the host's (see above)."""
    fd = os.open(f"/proc/{init}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _setns(fd, CLONE_NEWPID, "CLONE_NEWPID")
    finally:
        os.close(fd)
    errors_r, errors_w = os.pipe()
    mounter = os.fork()
    if mounter == 0:
        code = 1
        try:
            _check(_libc.umount2(b"/proc", MNT_DETACH), "umount /proc")
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            code = 0
        except OSError as error:
            os.write(errors_w, str(error).encode())
        finally:
            os._exit(code)
    os.close(errors_w)
    _, status = os.waitpid(mounter, 0)
    message = os.read(errors_r, 4096).decode(errors="replace")
    os.close(errors_r)
    if status != 0:
        raise OSError(f"cannot give the job its own /proc: {message or status}")


def _start_ticks(pid: int) -> int:
    """The process's start time in clock ticks since boot (names it together with the PID)."""
    with open(f"/proc/{pid}/stat", "rb") as handle:
        data = handle.read()
    return int(data[data.rindex(b")") + 2 :].split()[19])


PROBE_CHECK = """
import os, sys
own_proc = os.readlink("/proc/self") == "1"
mapped = open("/proc/self/uid_map").read().split() == ["0", "0", "4294967295"]
os.write(int(sys.argv[1]), b"ok" if own_proc and mapped else b"the job's init sees the wrong /proc or maps")
"""


def probe() -> str:
    """Start an init that only checks its namespaces, as jobs would get them; "" or what failed."""
    report_r, report_w = os.pipe()
    os.set_inheritable(report_w, True)
    argv = [sys.executable, "-S", "-c", PROBE_CHECK, str(report_w)]
    try:
        launch_in_user_namespace({"network_namespace": True}, argv)
    except OSError as error:
        return str(error)
    finally:
        os.close(report_w)
    answer = _read_exactly(report_r, 256).decode(errors="replace")
    os.close(report_r)
    if answer == "ok":
        return ""
    return answer or "the job's init did not start"


def exec_in_mount_yard(yard: str, mounts: dict[str, str], argv: list[str]) -> None:
    """Run `argv` (a CRIU restore) in a private mount namespace with each job mount bound alone.

    CRIU recreates a job's mount namespace inside the job's new user namespace, where the kernel
    locks every mount copied from outside to its submounts: a mount with submounts (/sys, /dev)
    can no longer be bind-mounted on its own. So in a private copy of the mount namespace (gone
    when CRIU exits) a tmpfs at `yard` gets one bind mount, without submounts, of "/" (as
    `yard`/root, for `--root`) and of each external mount by name; `argv` names those paths.
    """
    _unshare(CLONE_NEWNS, "CLONE_NEWNS")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("singularityd-yard", yard, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0700")
    for name, source in {YARD_ROOT: "/", **mounts}.items():
        if os.path.realpath(source) != os.path.normpath(source):
            raise OSError(f"mount point {source} of the checkpoint is now reached through a symbolic link")
        target = os.path.join(yard, name)
        if os.path.isdir(source):
            os.mkdir(target, 0o700)
        else:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        _mount(source, target, None, MS_BIND)
    os.execv(argv[0], argv)


def main() -> None:
    """Read the spec named on the command line, launch, print the supervisor's host PID."""
    if sys.argv[1] == PROBE_FLAG:
        problem = probe()
        print(problem or "ok", flush=True)
        sys.exit(1 if problem else 0)
    if sys.argv[1] == RESTORE_MOUNTS_FLAG:
        try:
            exec_in_mount_yard(sys.argv[2], json.loads(sys.argv[3]), sys.argv[4:])
        except OSError as error:
            print(f"cannot prepare the job's mounts for CRIU: {error}", file=sys.stderr)
        sys.exit(1)
    if sys.argv[1] == SUPERVISE_FLAG:
        with open(sys.argv[2]) as handle:
            _run_supervisor(json.load(handle))
    with open(sys.argv[1]) as handle:
        spec = json.load(handle)
    try:
        pid = launch(spec, os.path.abspath(sys.argv[1]))
    except OSError as error:
        print(f"launch failed: {error}", file=sys.stderr)
        sys.exit(1)
    print(pid, flush=True)


if __name__ == "__main__":
    main()
