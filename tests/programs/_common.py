"""Helpers shared by the corpus programs (plain torch, nothing from singularity).

With CORPUS_HOLD naming a file, a program waits for that file before it prints its final checksum
(so a test can checkpoint it as often as it likes before it ends); its output is the same.
"""

import hashlib
import os
import time

import torch


def hold() -> None:
    """Wait until the file CORPUS_HOLD names exists (at once when it names none)."""
    path = os.environ.get("CORPUS_HOLD")
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
