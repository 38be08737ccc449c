"""Command line of a proxy server process: listen on the job and control sockets, serve until stopped."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import os
import resource
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from . import host_kernels
from .control import ControlHandler
from .links import parse_peer_fds
from .pace import GRACE
from .service import Server


def _listen(path: str) -> socket.socket:
    """A Unix socket listening at `path` (replacing a stale one)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    return listener


def _accept_forever(listener: socket.socket, serve: Callable[[socket.socket], None]) -> None:
    """Serve every connection on `listener` in its own thread."""
    while True:
        try:
            connection, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=serve, args=(connection,), daemon=True).start()


def bound_host_memory(capacity: int) -> None:
    """Cap the process's data memory near what a virtual device holds (its memory is the device's).

    A job whose operation asks for far more than the device has then gets an allocation
    error in its program instead of waking the machine's out-of-memory killer.
    """
    status = Path("/proc/self/status").read_text()
    in_use = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmData:"))
    limit = in_use + capacity + max(capacity // 2, 2 << 30)
    _soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m singularity.proxy.server")
    parser.add_argument("--socket", required=True, help="Unix socket the job processes connect to")
    parser.add_argument("--control", help="control socket for the daemon (default: SOCKET.ctl)")
    parser.add_argument("--device-index", type=int, required=True)
    parser.add_argument("--memory-bytes", type=int, required=True)
    parser.add_argument("--cuda-device", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="intra-op CPU threads")
    parser.add_argument(
        "--splice-lean",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="spliced ranks take turns and wait in host memory (pace.py; default on)",
    )
    parser.add_argument(
        "--turn-grace",
        type=float,
        default=GRACE,
        help=f"seconds a spliced rank keeps its turn with nothing to run (default {GRACE})",
    )
    parser.add_argument("--name", default=None, help="device name the jobs see")
    parser.add_argument(
        "--listen-fd",
        type=int,
        default=None,
        help="an inherited, already listening socket for --socket (socket activation by the daemon)",
    )
    parser.add_argument(
        "--control-fd",
        type=int,
        default=None,
        help="an inherited, already listening socket for the daemon's control requests (else --control)",
    )
    parser.add_argument("--job-id", default=None, help="serve this job only (one server per job)")
    parser.add_argument("--job-uid", type=int, default=None, help="the uid whose processes may open sessions")
    parser.add_argument("--daemon-uid", type=int, default=None, help="who may reattach saved sessions")
    parser.add_argument(
        "--peer-fds",
        default="",
        help="INDEX:FD,...: inherited connections to the servers of the job's other devices (collectives)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run a proxy server until SIGTERM or SIGINT."""
    faulthandler.enable(all_threads=True)  # a crash in a kernel leaves every thread's stack in the log
    options = _arguments(argv)
    if options.threads:
        torch.set_num_threads(options.threads)
    host_kernels.install()
    server = Server(
        options.device_index,
        options.memory_bytes,
        options.cuda_device,
        options.name,
        job_id=options.job_id,
        job_uid=options.job_uid,
        daemon_uid=options.daemon_uid,
        splice_lean=options.splice_lean,
        turn_grace=options.turn_grace,
    )
    if options.cuda_device is None:
        bound_host_memory(options.memory_bytes)
    peers = {index: socket.socket(fileno=fd) for index, fd in parse_peer_fds(options.peer_fds).items()}
    for peer in peers.values():
        peer.setblocking(True)
    server.collectives.connect(peers)
    own_paths = []
    if options.control_fd is not None:
        control = socket.socket(fileno=options.control_fd)
        control.setblocking(True)
    else:
        control_path = options.control or options.socket + ".ctl"
        control = _listen(control_path)
        os.chmod(control_path, 0o600)
        own_paths.append(control_path)
    if options.listen_fd is not None:
        jobs = socket.socket(fileno=options.listen_fd)
        jobs.setblocking(True)
    else:
        jobs = _listen(options.socket)
        os.chmod(options.socket, 0o666)  # started by hand: whoever can reach the folder may connect
        own_paths.append(options.socket)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    gc.collect()
    gc.freeze()  # start-up's objects (torch's modules) live as long as the server: full collections skip them
    for listener, serve in ((control, ControlHandler(server, stop).serve), (jobs, server.serve_job)):
        threading.Thread(target=_accept_forever, args=(listener, serve), daemon=True).start()
    print(f"proxy: device {options.device_index} ready on {options.socket}", file=sys.stderr, flush=True)
    stop.wait()
    for path in own_paths:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Ended without finalizing, as the spawner ends the servers it starts: the sessions' daemon
    # threads may still be freeing tensors, and a thread inside torch when Python finalizes ends
    # the process in std::terminate (SIGABRT). Nothing a server holds outlives it.
    os._exit(code)
