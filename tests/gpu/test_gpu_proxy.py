"""The corpus against a real CUDA device behind the proxy (skipped without an NVIDIA GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.proxy.conftest import PROGRAMS, proxy_env, start_server, stop_server

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

PROGRAM_NAMES = [
    "mlp.py",
    "cnn.py",
    "transformer.py",
    "amp_scaler.py",
    "grad_clip.py",
    "lr_schedule.py",
    "checkpointing.py",
    "accelerator.py",
]


def test_corpus_on_real_gpu(tmp_path: Path) -> None:
    server = start_server(tmp_path, "gpu0", memory_bytes=8 << 30, cuda_device=0)
    try:
        for name in PROGRAM_NAMES:
            r = subprocess.run(
                [sys.executable, name],
                env=proxy_env([server.socket], f"gpu-{name}"),
                cwd=PROGRAMS,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert r.returncode == 0, (name, r.stderr[-3000:])
            assert "final" in r.stdout
    finally:
        stop_server(server)
