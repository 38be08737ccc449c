"""Helpers shared by the corpus programs (plain torch, nothing from singularity)."""

import hashlib

import torch


def checksum(module: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes, so that any bit of difference shows."""
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]
