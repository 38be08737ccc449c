"""Third-party code on proxied devices: Hugging Face transformers, and torch.compile as nanoGPT uses it."""

from __future__ import annotations

import subprocess

from singularity.proxy.bootstrap._singularity_proxy.compiler import NOTICE
from tests.proxy.conftest import PROGRAMS, PYTHON, ProxyServer, base_env, proxy_env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, *args], env=env, cwd=PROGRAMS, capture_output=True, text=True, timeout=300,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_transformers_gpt2_trains_and_generates_byte_identically(server: ProxyServer) -> None:
    direct = _run(["hf_gpt2.py", "--device", "cpu"], base_env())
    proxied = _run(["hf_gpt2.py", "--device", "cuda"], proxy_env([server.socket], "hf-gpt2"))
    assert direct.returncode == 0, direct.stderr
    assert proxied.returncode == 0, proxied.stderr
    assert "greedy" in direct.stdout and "sampled" in direct.stdout and "beams" in direct.stdout
    assert proxied.stdout == direct.stdout


def test_compiled_model_runs_eagerly_and_says_so_once(server: ProxyServer) -> None:
    direct = _run(["compiled_gpt.py", "--device", "cpu", "--compile", "0"], base_env())
    proxied = _run(
        ["compiled_gpt.py", "--device", "cuda", "--compile", "1"], proxy_env([server.socket], "compiled")
    )
    assert direct.returncode == 0, direct.stderr
    assert proxied.returncode == 0, proxied.stderr
    assert "final" in direct.stdout
    assert proxied.stdout == direct.stdout
    assert proxied.stderr.count(NOTICE.strip()) == 1, proxied.stderr
