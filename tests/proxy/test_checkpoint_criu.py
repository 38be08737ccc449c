"""Preempt and resume a proxied job with CRIU, moving it between proxy servers.

The job is quiesced through the proxy, its live tensors saved, the process dumped with
its proxy socket declared external, the tensors released, loaded into the other server,
and the process restored with a fresh connection; several times, at random moments.
The output must equal an uninterrupted run byte for byte.
"""

from __future__ import annotations

import ctypes
import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from singularity.proxy.control import (
    ProxyControl,
    client_sockets,
    criu_dump_args,
    criu_restore_args,
    open_restored_connection,
)
from tests.proxy.conftest import (
    PROGRAMS,
    PYTHON,
    REPO,
    base_env,
    proxy_env,
    start_server,
    stop_server,
)

CRIU = REPO / ".venv" / "criu" / "criu"
PR_SET_CHILD_SUBREAPER = 36

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0 or not CRIU.exists(), reason="needs root and CRIU"),
]


def _criu(*args: str, pass_fds: tuple[int, ...] = ()) -> None:
    for attempt in range(5):
        r = subprocess.run(
            [str(CRIU), *args], capture_output=True, text=True, pass_fds=pass_fds, stdin=subprocess.DEVNULL
        )
        if r.returncode == 0:
            return
        if "File exists" in r.stderr and attempt < 4:  # the dumped pid not yet gone
            time.sleep(0.2)
            continue
        raise AssertionError(f"criu {args[0]} failed:\n{r.stderr[-3000:]}")


def _wait_exit(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    raise AssertionError(f"process {pid} did not finish")


def _lines(path: Path) -> int:
    return path.read_text().count("\n")


def test_preempt_resume_across_servers(tmp_path: Path) -> None:
    args = ["long_train.py", "--steps", "150"]
    ref = subprocess.run(
        [PYTHON, *args],
        env=base_env(),
        cwd=PROGRAMS,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert ref.returncode == 0, ref.stderr
    total = ref.stdout.count("\n")

    # the restored job is re-parented to us, so that we can reap it
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    servers = [start_server(tmp_path, "a"), start_server(tmp_path, "b")]
    rng = random.Random(int(os.environ.get("SING_TEST_SEED", "4")))
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    try:
        with out.open("w") as fo, err.open("w") as fe:
            proc = subprocess.Popen(
                [PYTHON, *args],
                cwd=PROGRAMS,
                stdin=subprocess.DEVNULL,
                stdout=fo,
                stderr=fe,
                start_new_session=True,
                env=proxy_env([servers[0].socket], "criu-job"),
            )
        pid = proc.pid
        cur = 0
        cycles = 0
        seen_lines: list[int] = []
        live: list[int] = []
        waiting: set[bool] = set()
        # on a slow machine the first cuts may all come before the program prints: cut on until one does not
        while cycles < 24 and (cycles < 5 or len(waiting) < 2 or not any(seen_lines)):
            time.sleep(rng.uniform(0.05, 0.5))
            if proc.poll() is not None if cycles == 0 else not Path(f"/proc/{pid}").exists():
                break
            if not client_sockets(pid):
                continue  # not connected to the proxy yet
            if _lines(out) > total - 8:
                break  # too close to the end to be sure of another cut
            src, dst = servers[cur], servers[1 - cur]
            images = tmp_path / f"img{cycles}"
            tensors = tmp_path / f"tensors{cycles}"
            images.mkdir()
            with ProxyControl(src.control) as ctl:
                assert ctl.quiesce("criu-job") == [0]
                report = ctl.save("criu-job", tensors)
                assert report["file_bytes"] > 0
                live.append(report["live_bytes"])
                waiting.add(ctl.status()["jobs"]["criu-job/0"]["waiting"])
                old = client_sockets(pid)
                _criu("dump", "-t", str(pid), "-D", str(images), *criu_dump_args(pid))
                if cycles == 0:
                    proc.wait()
                else:
                    os.waitpid(pid, 0)  # CRIU killed the restored process; reap it
                assert ctl.release("criu-job") == report["live_bytes"]
                assert ctl.status()["allocated"] == 0
            seen_lines.append(_lines(out))
            with ProxyControl(dst.control) as ctl:
                assert ctl.load("criu-job", tensors)["live_bytes"] == report["live_bytes"]
                conn = open_restored_connection(dst.socket, "criu-job", 0, 0, pid)
                try:
                    _criu(
                        "restore",
                        "-D",
                        str(images),
                        "--restore-detached",
                        *criu_restore_args(old, {0: conn}),
                        pass_fds=(conn.fileno(),),
                    )
                finally:
                    conn.close()
                assert ctl.resume("criu-job") == [0]
            cur = 1 - cur
            cycles += 1
        code = _wait_exit(pid, 300) if cycles else proc.wait(300)
        assert code == 0, err.read_text()[-3000:]
    finally:
        for s in servers:
            stop_server(s)
    assert cycles >= 5, f"only {cycles} preemptions happened"
    # some cuts caught the program waiting on a value, others while it issued work
    assert waiting == {True, False}, waiting
    assert out.read_text() == ref.stdout
    # cuts fell inside the training loop, not only before it or after it
    assert 0 < max(seen_lines) < total, seen_lines
    assert max(live) > 0
