"""Starts proxy servers with the privileges of the job they serve, from a warmed-up interpreter.

The daemon must not import torch, nor fork while gRPC runs, and a server started from scratch
spends about a second importing torch. So the daemon starts one spawner (`python -m
singularity.proxy.spawner --channel-fd N`, as root): it imports torch and the proxy server once,
then for each request that arrives on its private socketpair it forks a child that gives up
everything the job's user lacks - supplementary groups, gids and uids, every capability
(including the bounding and ambient sets), the right to gain privileges through exec, and core
dumps and ptrace by that user - and runs the server's `main` with the file descriptors the daemon
passed along. Only the daemon holds the other end of the socketpair. Being the servers' parent,
it also tells the daemon how one ended (`SpawnerClient.ended`), which the daemon cannot learn.

`SpawnerClient` is the daemon's side; it imports only the standard library.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import importlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_REQUEST_BYTES = 64 << 10
MAX_FDS = 64
ORPHAN_CHECK_SECONDS = 1.0
ENDED_KEPT = 1024
"""How many ended children's wait statuses the spawner keeps for the daemon to ask about."""
PRELOAD = ("torch", "singularity.proxy.server.__main__")

PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522
CAPSET_SYSCALL = {"x86_64": 126, "aarch64": 91}


class SpawnError(RuntimeError):
    """The spawner could not start the requested process; the message says why."""


@dataclass(frozen=True)
class SpawnRequest:
    """One process to start: its module and arguments, identity, environment and inherited fds.

    `fds` maps a descriptor number in the child to an open descriptor of the caller; the child
    gets each at that number and no other descriptor beyond stdin, stdout and stderr.
    """

    module: str
    argv: Sequence[str]
    uid: int
    gid: int
    groups: Sequence[int] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str = "/"
    fds: Mapping[int, int] = field(default_factory=dict)
    log_path: str = ""

    def message(self) -> bytes:
        """The JSON body sent to the spawner (the fds travel beside it, in the same order)."""
        return json.dumps(
            {
                "module": self.module,
                "argv": list(self.argv),
                "uid": self.uid,
                "gid": self.gid,
                "groups": list(self.groups),
                "env": dict(self.env),
                "cwd": self.cwd,
                "targets": list(self.fds),
                "log_path": self.log_path,
            }
        ).encode()


class SpawnerClient:
    """The daemon's handle on its spawner process: start it, ask it for processes, stop it."""

    def __init__(self, python: str = sys.executable, preload: Sequence[str] = PRELOAD) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._channel = ours
        self._lock = threading.Lock()
        command = [python, "-m", "singularity.proxy.spawner", "--channel-fd", str(theirs.fileno())]
        for module in preload:
            command += ["--preload", module]
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(),),
            start_new_session=True,
            cwd="/",
        )
        theirs.close()
        ready = self._channel.recv(64)
        if ready != b"ready":
            self.close()
            raise SpawnError(f"the proxy spawner did not start (exit status {self.process.poll()})")

    def spawn(self, request: SpawnRequest) -> int:
        """Start a process as the request says; returns its PID (it is not this process's child)."""
        if len(request.fds) > MAX_FDS:
            raise SpawnError(f"at most {MAX_FDS} descriptors can be passed, not {len(request.fds)}")
        with self._lock:
            socket.send_fds(self._channel, [request.message()], list(request.fds.values()))
            reply = json.loads(self._channel.recv(MAX_REQUEST_BYTES) or b'{"error": "the spawner ended"}')
        if "error" in reply:
            raise SpawnError(str(reply["error"]))
        return int(reply["pid"])

    def ended(self, pid: int) -> int | None:
        """How a process this spawner started ended, as a wait status (None: it runs, it was not
        started by this spawner, or its end is long forgotten), since only its parent can know."""
        with self._lock:
            self._channel.send(json.dumps({"ended": pid}).encode())
            reply = json.loads(self._channel.recv(MAX_REQUEST_BYTES) or b"{}")
        status = reply.get("status")
        return status if isinstance(status, int) else None

    def close(self) -> None:
        """Stop the spawner; the processes it started keep running."""
        self._channel.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


# The spawner process itself (root; torch and the server already imported).

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _last_capability() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as handle:
            return int(handle.read())
    except OSError:
        return 63


def _clear_capabilities() -> None:
    """Empty the effective, permitted and inheritable sets (a root job's server keeps uid 0)."""
    header = struct.pack("Ii", LINUX_CAPABILITY_VERSION_3, 0)
    data = bytes(24)  # two {effective, permitted, inheritable} u32 triples
    header_buf = ctypes.create_string_buffer(header)
    data_buf = ctypes.create_string_buffer(data)
    number = CAPSET_SYSCALL.get(os.uname().machine)
    if number is None:
        raise OSError(f"capset: unknown system call number on {os.uname().machine}")
    _check(_libc.syscall(number, header_buf, data_buf), "capset")


def drop_privileges(uid: int, gid: int, groups: Sequence[int]) -> None:
    """Become uid/gid with only `groups`, holding no capability and unable to gain any.

    A spawner that is not root (a user-mode daemon) can only start processes as its own user;
    they still lose the ability to gain privileges and to be traced or dumped.
    """
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    if os.geteuid() != 0:
        if uid != os.geteuid():
            raise PermissionError(f"a spawner running as uid {os.geteuid()} cannot start uid {uid}")
        _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "PR_SET_DUMPABLE")
        return
    for capability in range(_last_capability() + 1):
        if _libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0 and ctypes.get_errno() != 22:
            _check(-1, f"PR_CAPBSET_DROP {capability}")
    os.setgroups(list(groups))
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    _clear_capabilities()
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "PR_SET_DUMPABLE")


def entry_point(module_name: str) -> Any:
    """The `main` of a module, or of its `__main__` when it is a package run with `python -m`."""
    module = importlib.import_module(module_name)
    if not hasattr(module, "main"):
        module = importlib.import_module(f"{module_name}.__main__")
    return module.main


def _child(request: dict[str, Any], received: list[int], channel: socket.socket, report: int) -> None:
    """Runs in the forked child: set the process up as asked, then run the module's main.

    Once it holds no more privilege than asked it writes "ok" to `report` (an error text instead
    when set-up fails) and closes it, so the spawner answers only for a process that is safe.
    """
    code = 70
    try:
        channel.close()
        os.setsid()
        for number in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(number, signal.SIG_DFL)
        # As in any Python process: a peer that hangs up before its answer (a control client
        # giving up) makes the write raise BrokenPipeError, not kill the server.
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        targets = [int(t) for t in request["targets"]]
        clear = max(targets, default=2) + 1
        """Descriptors at or above this are out of the way of the target numbers."""
        parked = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, clear) for fd in received]
        for fd in received:
            os.close(fd)
        moved = fcntl.fcntl(report, fcntl.F_DUPFD_CLOEXEC, clear)
        os.close(report)
        report = moved
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        log = devnull
        if request.get("log_path"):
            log = os.open(request["log_path"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            os.fchown(log, int(request["uid"]), int(request["gid"]))
        os.dup2(log, 1)
        os.dup2(log, 2)
        for fd, target in zip(parked, targets, strict=True):
            os.dup2(fd, target, inheritable=True)
        keep = {0, 1, 2, report, *targets}
        for fd in range(3, max([*keep, *parked, devnull, log]) + 1):
            if fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        os.closerange(max(keep) + 1, 1 << 16)
        os.umask(0o077)
        drop_privileges(int(request["uid"]), int(request["gid"]), [int(g) for g in request["groups"]])
        os.chdir(request["cwd"])
        os.write(report, b"ok")
        os.close(report)
        report = -1
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in request["env"].items()})
        sys.argv = [request["module"], *request["argv"]]
        main = entry_point(request["module"])
        code = int(main(list(request["argv"])) or 0)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException as error:  # report and end the child, never return into the spawner
        with contextlib.suppress(Exception):
            if report >= 0:
                os.write(report, f"{type(error).__name__}: {error}".encode()[:4000])
        with contextlib.suppress(Exception):
            print(f"spawner: {request.get('module')}: {type(error).__name__}: {error}", file=sys.stderr)
        code = 70
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


_ended: dict[int, int] = {}
"""The wait statuses of the children reaped last, by PID, until the daemon asks for them."""


def _reap(*_: Any) -> None:
    """Collect ended children so they do not stay zombies while the spawner lives, keeping how
    each ended for the daemon (which watches them, but only a parent learns a wait status)."""
    with contextlib.suppress(ChildProcessError):
        while True:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            _ended[pid] = status
            while len(_ended) > ENDED_KEPT:
                del _ended[next(iter(_ended))]


def _ended_status(pid: Any) -> int | None:
    """The wait status of an ended child, once (None: unknown, or still running)."""
    _reap()
    return _ended.pop(pid, None) if isinstance(pid, int) else None


def _validate(request: Any, received: list[int]) -> dict[str, Any]:
    if not isinstance(request, dict):
        raise SpawnError("a spawn request must be a JSON object")
    for key, kind in (("module", str), ("argv", list), ("uid", int), ("gid", int), ("groups", list),
                      ("env", dict), ("cwd", str), ("targets", list)):  # fmt: skip
        if not isinstance(request.get(key), kind):
            raise SpawnError(f"spawn request field {key!r} must be {kind.__name__}")
    if len(request["targets"]) != len(received):
        raise SpawnError("spawn request names a different number of descriptors than it passed")
    if any(not isinstance(t, int) or t < 3 or t > 4096 for t in request["targets"]):
        raise SpawnError("descriptor targets must be between 3 and 4096")
    return request


def _start(request: dict[str, Any], received: list[int], channel: socket.socket) -> dict[str, Any]:
    """Fork the child and wait until it has given up its privileges; the reply for the daemon."""
    readable, writable = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(readable)
        _child(request, received, channel, writable)
    os.close(writable)
    with os.fdopen(readable, "rb") as report:
        outcome = report.read().decode(errors="replace")
    if outcome != "ok":
        return {"error": f"cannot start {request['module']} as uid {request['uid']}: {outcome or 'it died'}"}
    return {"pid": pid}


def serve(channel: socket.socket) -> int:
    """Answer spawn requests from the daemon until it closes the channel or dies.

    The daemon's death is also noticed by the spawner being orphaned: a copy of the daemon's end
    of the channel held by some other process must not keep a root spawner alive.
    """
    signal.signal(signal.SIGCHLD, _reap)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    daemon = os.getppid()
    channel.send(b"ready")
    while True:
        if not select.select([channel], [], [], ORPHAN_CHECK_SECONDS)[0]:
            if os.getppid() != daemon:
                return 0
            continue
        try:
            body, received, _flags, _address = socket.recv_fds(channel, MAX_REQUEST_BYTES, MAX_FDS)
        except InterruptedError:
            continue
        if not body:
            return 0
        try:
            message = json.loads(body)
            if isinstance(message, dict) and "ended" in message:
                channel.send(json.dumps({"status": _ended_status(message["ended"])}).encode())
                continue
            request = _validate(message, received)
            channel.send(json.dumps(_start(request, received, channel)).encode())
        except (SpawnError, OSError, ValueError) as error:
            channel.send(json.dumps({"error": str(error)}).encode())
        finally:
            for fd in received:
                with contextlib.suppress(OSError):
                    os.close(fd)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the spawner process (started by the daemon's SpawnerClient)."""
    parser = argparse.ArgumentParser(prog="python -m singularity.proxy.spawner")
    parser.add_argument("--channel-fd", type=int, required=True, help="the daemon's end of a socketpair")
    parser.add_argument("--preload", action="append", default=[], help="a module to import before forking")
    args = parser.parse_args(argv)
    for module in args.preload:
        importlib.import_module(module)
    channel = socket.socket(fileno=args.channel_fd)
    return serve(channel)


if __name__ == "__main__":
    sys.exit(main())
