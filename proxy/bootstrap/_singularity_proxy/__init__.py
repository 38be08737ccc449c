"""The in-job client of the singularity device proxy (standard library and torch only)."""

from __future__ import annotations

import os

ENV_SOCKETS = "SING_PROXY_SOCKETS"


def activate() -> bool:
    """Install the client if the daemon gave this process proxied devices; say whether it did."""
    sockets = os.environ.get(ENV_SOCKETS, "")
    if not sockets:
        return False
    from . import patches

    if patches._installed:
        return True
    paths = [p for p in sockets.split(",") if p]
    rank = int(os.environ.get("RANK", "0") or 0)
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    job_id = os.environ.get("SING_JOB_ID", "") or f"pid-{os.getpid()}"
    patches.install(paths, job_id, rank, local_rank)
    return True
