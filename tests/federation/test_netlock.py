"""The network lock a stopping dump leaves behind is found from its images and deleted.

A real CRIU dump (with --tcp-established and the nftables lock) of a process holding a loopback TCP
connection, in a network namespace of its own, run by tests/federation/netlock_probe.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from singularityd.checkpoint import CheckpointUnavailable, locate_criu
from tests.helpers import REPO

pytestmark = pytest.mark.root


def test_the_lock_of_a_dump_that_stopped_the_job_stays_until_deleted(tmp_path: Path) -> None:
    try:
        criu = locate_criu("auto")
    except CheckpointUnavailable as error:
        pytest.skip(f"no usable CRIU: {error}")
    if criu.network_lock != "nftables" or shutil.which("unshare") is None:
        pytest.skip("needs CRIU's nftables network lock and unshare")
    probe = [sys.executable, str(REPO / "tests" / "federation" / "netlock_probe.py"), str(tmp_path)]
    done = subprocess.run(
        ["unshare", "--net", "--", *probe, *criu.argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["after_dump"] == seen["named"] and len(seen["named"]) == 1, seen
    assert seen["deleted"] == [True] and seen["deleted_again"] == [False], seen
    assert seen["after_delete"] == [], seen
