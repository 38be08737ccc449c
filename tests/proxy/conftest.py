"""Fixtures for the device proxy tests: real proxy server processes and job processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from singularity.proxy import bootstrap_path
from singularityd.jobs.launch import free_tcp_port

REPO = Path(__file__).resolve().parents[2]
PROGRAMS = REPO / "tests" / "programs"
PYTHON = sys.executable


@dataclass
class ProxyServer:
    """A running proxy server process."""

    socket: Path
    control: Path
    proc: subprocess.Popen[bytes]


def base_env() -> dict[str, str]:
    """Environment of a job process without the proxy: one intra-op thread."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SING_")}
    env["OMP_NUM_THREADS"] = "1"
    env.pop("PYTHONPATH", None)
    return env


def proxy_env(
    sockets: Sequence[Path], job_id: str = "job", rank: int = 0, tree: Path = REPO
) -> dict[str, str]:
    """Environment the daemon gives a job process on proxied devices (client from source `tree`)."""
    env = base_env()
    env["PYTHONPATH"] = str(bootstrap_path() if tree == REPO else tree / "proxy" / "bootstrap")
    env["SING_PROXY_SOCKETS"] = ",".join(str(s) for s in sockets)
    env["SING_JOB_ID"] = job_id
    env["RANK"] = str(rank)
    env["WORLD_SIZE"] = "1"
    env["LOCAL_RANK"] = "0"
    return env


def start_server(
    directory: Path,
    name: str,
    memory_bytes: int = 1 << 30,
    index: int = 0,
    cuda_device: int | None = None,
    tree: Path = REPO,
) -> ProxyServer:
    """Start `python -m singularity.proxy.server` (on GPU `cuda_device` if given); wait until it listens.

    `tree` is the source tree whose server runs (another checkout for side-by-side benchmarks).
    """
    sock = directory / f"{name}.sock"
    command = [
        PYTHON, "-m", "singularity.proxy.server", "--socket", str(sock), "--device-index", str(index),
        "--memory-bytes", str(memory_bytes), "--threads", "1",
    ]  # fmt: skip
    if cuda_device is not None:
        command += ["--cuda-device", str(cuda_device)]
    proc = subprocess.Popen(
        command,
        env=base_env(),
        cwd=tree,
        stdin=subprocess.DEVNULL,
    )
    ctl = Path(str(sock) + ".ctl")
    deadline = time.monotonic() + 60
    while not (sock.exists() and ctl.exists()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"proxy server {name} did not start")
        time.sleep(0.05)
    return ProxyServer(sock, ctl, proc)


def start_linked_servers(
    directory: Path, count: int, memory_bytes: int = 1 << 30, options: Sequence[str] = ()
) -> list[ProxyServer]:
    """Servers of one job's `count` devices (dev0.sock...), linked pairwise as the daemon links them
    (with these further command-line options)."""
    links: dict[tuple[int, int], socket.socket] = {}
    for i in range(count):
        for j in range(i + 1, count):
            links[(i, j)], links[(j, i)] = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    servers = []
    try:
        for i in range(count):
            peers = {j: sock for (a, j), sock in links.items() if a == i}
            sock = directory / f"dev{i}.sock"
            command = [
                PYTHON, "-m", "singularity.proxy.server", "--socket", str(sock), "--device-index", str(i),
                "--memory-bytes", str(memory_bytes), "--threads", "1", *options,
            ]  # fmt: skip
            if peers:
                command += ["--peer-fds", ",".join(f"{j}:{s.fileno()}" for j, s in peers.items())]
            proc = subprocess.Popen(
                command, env=base_env(), cwd=REPO, pass_fds=[s.fileno() for s in peers.values()],
                stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            servers.append(ProxyServer(sock, Path(f"{sock}.ctl"), proc))
    finally:
        for link in links.values():
            link.close()
    deadline = time.monotonic() + 60
    while not all(s.socket.exists() and s.control.exists() for s in servers):
        if any(s.proc.poll() is not None for s in servers) or time.monotonic() > deadline:
            raise RuntimeError("proxy servers did not start")
        time.sleep(0.05)
    return servers


def start_ranks(
    args: Sequence[str], ranks: int, sockets: Sequence[Path] | None, **extra: str
) -> list[subprocess.Popen[str]]:
    """The ranks of a torchrun-style job (proxied on `sockets`, else directly on the CPU)."""
    port = str(free_tcp_port())
    processes = []
    for rank in range(ranks):
        env = proxy_env(sockets, rank=rank) if sockets else base_env()
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, USE_LIBUV="0", **extra)
        command = [PYTHON, *args]
        pipe = subprocess.PIPE
        processes.append(
            subprocess.Popen(
                command, env=env, cwd=PROGRAMS, stdout=pipe, stderr=pipe, text=True, stdin=subprocess.DEVNULL
            )
        )
    return processes


def communicate_all(processes: Sequence[subprocess.Popen[str]], timeout: float) -> list[tuple[str, str]]:
    """Each process's (stdout, stderr) once it ends, all read side by side: read one after another,
    a rank that fills its pipe (64 KiB) would block, and every rank waiting for it in a collective."""
    with ThreadPoolExecutor(max(1, len(processes))) as pool:
        return list(pool.map(lambda process: process.communicate(timeout=timeout), processes))


def aborted_at_exit(codes: Sequence[int | None]) -> bool:
    """Whether ranks ended as torch sometimes ends gloo processes at interpreter exit, after the
    program is done ("terminate called without an active exception", SIGABRT; about 1 run in 12
    here): some aborted, the others succeeded."""
    return -signal.SIGABRT in codes and set(codes) <= {0, -signal.SIGABRT}


def direct_ranks(program: str, args: Sequence[str], ranks: int, timeout: float = 300) -> list[str]:
    """Each rank's stdout when the program runs directly on the CPU, torchrun-style, without the
    proxy or singularityd; a run that torch aborted at exit (`aborted_at_exit`) is run again, once."""
    for attempt in range(2):
        processes = start_ranks([program, *args], ranks, None)
        outputs = communicate_all(processes, timeout)
        codes = [process.returncode for process in processes]
        if attempt == 0 and aborted_at_exit(codes):
            continue
        break
    assert codes == [0] * ranks, [err[-2000:] for _, err in outputs]
    return [out for out, _ in outputs]


def stop_server(server: ProxyServer) -> None:
    """Terminate a proxy server process."""
    server.proc.terminate()
    try:
        server.proc.wait(10)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyServer]:
    """One virtual device with 1 GiB, shared by the tests of a session."""
    s = start_server(tmp_path_factory.mktemp("proxy"), "dev0")
    yield s
    stop_server(s)


def run_program(
    args: Sequence[str], env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run a corpus program (from tests/programs) to completion."""
    return subprocess.run(
        [PYTHON, *args],
        env=env,
        cwd=PROGRAMS,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
