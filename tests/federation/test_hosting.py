"""The PREPARE check: a target refuses, in one line, what it cannot host."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from singularityd.federation.hosting import HostFacts, MoveSpec, gather_host_facts, hosting_problem, probe_cwd

SPEC = MoveSpec(
    "job-1", "root", 0, "/srv/run", gpus=2, ranks=2, checkpoint_bytes=1 << 30, cwd_entries=("train.py",)
)
FINE = HostFacts(user_uid=0, cwd_is_dir=True, cwd_entries_missing=(), devices=4, free_disk_bytes=10 << 30,
                 checkpoints_available=True)  # fmt: skip


def test_a_node_that_can_host_says_nothing() -> None:
    assert hosting_problem(SPEC, FINE) == ""


@pytest.mark.parametrize(
    ("facts", "reason"),
    [
        (replace(FINE, draining=True), "draining"),
        (replace(FINE, checkpoints_available=False), "checkpoints are unavailable"),
        (replace(FINE, user_uid=None), "user root does not exist"),
        (replace(FINE, user_uid=1000), "has uid 1000 on this node, not 0"),
        (replace(FINE, cwd_is_dir=False), "/srv/run does not exist on this node (it must be shared)"),
        (
            replace(FINE, cwd_entries_missing=("train.py",)),
            "not the job's working directory: it lacks train.py",
        ),
        (replace(FINE, devices=1), "needs 2 devices; this node has 1"),
        (replace(FINE, free_disk_bytes=1 << 30), "not enough disk"),
    ],
)
def test_each_reason_to_refuse_is_said_plainly(facts: HostFacts, reason: str) -> None:
    assert reason in hosting_problem(SPEC, facts)


def test_the_spec_travels_as_json() -> None:
    assert MoveSpec.from_json(SPEC.to_json()) == SPEC
    with pytest.raises(ValueError, match="malformed move spec"):
        MoveSpec.from_json(b'{"job_id": "x"}')


def test_a_directory_with_the_same_path_but_other_files_is_not_the_working_directory(tmp_path: Path) -> None:
    shared = tmp_path / "run"
    shared.mkdir()
    (shared / "train.py").write_text("")
    (shared / "data").mkdir()
    spec = replace(SPEC, cwd=str(shared), cwd_entries=probe_cwd(str(shared)), gpus=1)
    assert spec.cwd_entries == ("data", "train.py")
    facts = gather_host_facts(spec, tmp_path, devices=1, checkpoints_available=True)
    assert facts.user_uid == 0 and facts.cwd_is_dir and hosting_problem(spec, facts) == ""
    os.remove(shared / "train.py")  # as a same-named directory on an unshared disk would look
    facts = gather_host_facts(spec, tmp_path, devices=1, checkpoints_available=True)
    assert hosting_problem(spec, facts).endswith("it lacks train.py")
    facts = gather_host_facts(
        replace(spec, user="no-such-user-here"), tmp_path, devices=1, checkpoints_available=True
    )
    assert facts.user_uid is None


def test_a_count_of_one_is_said_in_the_singular() -> None:
    one = replace(SPEC, gpus=1, ranks=1)
    full, one_free = replace(FINE, free_devices=0), replace(FINE, free_devices=1)
    assert hosting_problem(one, full) == "no room: the job needs 1 device; 0 of 4 free"
    assert hosting_problem(SPEC, one_free) == "no room: the job needs 2 devices; 1 of 4 free"
