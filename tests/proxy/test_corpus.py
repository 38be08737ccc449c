"""Each corpus program prints the same bytes on the CPU directly and on a proxied cuda device."""

from __future__ import annotations

import subprocess

import pytest

from tests.proxy.conftest import PROGRAMS, PYTHON, ProxyServer, base_env, proxy_env

CORPUS: list[tuple[str, list[str], list[str]]] = [
    ("mlp.py", [], []),
    ("cnn.py", ["--device", "cpu"], ["--device", "cuda"]),
    ("lstm_lm.py", [], []),
    ("transformer.py", [], []),
    ("amp_scaler.py", [], []),
    ("grad_clip.py", [], []),
    ("lr_schedule.py", [], []),
    ("checkpointing.py", [], []),
    ("accelerator.py", [], []),
    ("long_train.py", ["--steps", "10"], ["--steps", "10"]),
    ("legacy_gan.py", [], []),
]


@pytest.mark.parametrize(("program", "direct_args", "proxy_args"), CORPUS, ids=[c[0] for c in CORPUS])
def test_same_output_direct_and_proxied(
    server: ProxyServer, program: str, direct_args: list[str], proxy_args: list[str]
) -> None:
    job = f"corpus-{program}"
    pipe, null = subprocess.PIPE, subprocess.DEVNULL
    direct = subprocess.Popen(
        [PYTHON, program, *direct_args],
        env=base_env(),
        cwd=PROGRAMS,
        stdin=null,
        stdout=pipe,
        stderr=pipe,
        text=True,
    )
    proxied = subprocess.Popen(
        [PYTHON, program, *proxy_args],
        cwd=PROGRAMS,
        env=proxy_env([server.socket], job),
        stdin=null,
        stdout=pipe,
        stderr=pipe,
        text=True,
    )
    d_out, d_err = direct.communicate(timeout=180)
    p_out, p_err = proxied.communicate(timeout=180)
    assert direct.returncode == 0, d_err
    assert proxied.returncode == 0, p_err
    assert "final" in d_out
    assert p_out == d_out
