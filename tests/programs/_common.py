"""Helpers shared by the corpus programs (plain torch, nothing from singularity).

With CORPUS_HOLD naming a file, a program waits for that file before it prints its final checksum
(so a test can checkpoint it as often as it likes before it ends); its output is the same.
"""

import hashlib
import os
import socket
import time
from collections.abc import Callable

import torch
import torch.multiprocessing as mp


def hold(path: str | None = None) -> None:
    """Wait until the file `path`, else the one CORPUS_HOLD names, exists (at once when neither
    names one)."""
    path = path or os.environ.get("CORPUS_HOLD")
    while path and not os.path.exists(path):
        time.sleep(0.05)


def checksum(module: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes, so that any bit of difference shows."""
    hold()
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def spawn_on_a_free_port(run: Callable[[int, str, int], None], device: str, processes: int = 2) -> None:
    """Spawn `processes` processes running run(rank, device, port), with a free local TCP port
    for their rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    mp.spawn(run, args=(device, free), nprocs=processes, join=True)
