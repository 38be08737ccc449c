"""The sitecustomize activation: inert without the proxy env, chains to other sitecustomizes."""

from __future__ import annotations

import subprocess
from pathlib import Path

from singularity.proxy import bootstrap_path
from tests.proxy.conftest import PYTHON, ProxyServer, base_env, proxy_env

PROBE = "import sys; print('torch' in sys.modules, 'chained' in sys.modules)"


def _run(code: str, env: dict[str, str]) -> str:
    r = subprocess.run(
        [PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_chains_and_stays_inert_without_sockets(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import sys\nsys.modules['chained'] = sys\n")
    env = base_env()
    env["PYTHONPATH"] = f"{bootstrap_path()}:{other}"
    assert _run(PROBE, env) == "False True\n"
    installed = "'_singularity_proxy.devices' in __import__('sys').modules"
    code = f"import torch; print(torch.cuda.is_available(), {installed})"
    assert _run(code, env) == "False False\n"


def test_activates_only_when_torch_is_imported(server: ProxyServer, tmp_path: Path) -> None:
    env = proxy_env([server.socket], "boot")
    assert _run(PROBE, env) == "False False\n"
    code = "import torch; print(torch.cuda.is_available(), torch.cuda.device_count())"
    assert _run(code, env) == "True 1\n"


SEMAPHORE_MAPS = """
import multiprocessing
lock = multiprocessing.get_context("spawn").Lock()
with lock:
    print([line.split(maxsplit=5)[-1].strip() for line in open("/proc/self/maps") if "/dev/shm/sem." in line])
"""


def test_spawn_semaphores_are_mapped_by_their_name() -> None:
    """A semaphore made for spawned processes is mapped under the name they open it by, not glibc's
    deleted temporary name, which CRIU refuses to dump ("Can't create link remap")."""
    env = base_env()
    env["PYTHONPATH"] = str(bootstrap_path())
    (path,) = eval(_run(SEMAPHORE_MAPS, env))
    assert path.startswith("/dev/shm/sem.mp-") and not path.endswith("(deleted)")


THREADS_AT_EXIT = """
import atexit, os, sys, threading
# every thread, the client's too (threading.enumerate leaves the client's reader threads out)
others = lambda: sorted(t.name for t in threading._enumerate() if t is not threading.main_thread())
atexit.register(lambda: print(others()))
import torch
x = torch.ones(4, device="cuda") * 2
if os.fork() == 0:
    sys.exit(0)  # the child's exit runs the atexit handlers it inherited
os.wait()
print((x * 2).sum().item(), flush=True)
"""


def test_no_thread_of_the_client_outlives_the_program(server: ProxyServer) -> None:
    """Once the program's own exit handlers ran, the client has sent what it queued and ended its
    reader threads (a daemon thread inside torch when Python finalizes aborts the process: exit 134
    after the program is done); a forked child that exits leaves its parent's connection open."""
    assert _run(THREADS_AT_EXIT, proxy_env([server.socket], "exit")) == "[]\n16.0\n[]\n"
