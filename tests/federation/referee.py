"""The referee of the fault tests: watches /proc and the daemons' records for copies of a job.

A copy of a job is a process whose command line holds the trial's marker; it belongs to the node
whose mount namespace it lives in. A copy is *live* when it can execute the job's code: it exists,
is not a zombie, is not dying (exiting, or with a SIGKILL pending: it never returns to its code),
is not stopped (`T`, SIGSTOP or CRIU's `--leave-stopped`) or about to stop (a SIGSTOP pending,
as CRIU's detach with SIGSTOP leaves it until the task is next scheduled: a pending signal is
taken before any user code runs, and SIGSTOP cannot be blocked) or held in a tracing stop (`t`, CRIU's
ptrace freeze of a dump), and is not under a running `criu restore --leave-stopped`: such a CRIU
restores its tasks (which already show the job's command line while they run CRIU's restorer
code), then stops them and detaches; none of them runs the job's code before someone continues
it after CRIU is gone. Any other copy is *dormant*. (Sampled through real restores with
`--leave-stopped` followed by SIGKILL: every sample the earlier rule, "not stopped", called live
was a task with CRIU as an ancestor, or one dying with SIGKILL pending or PF_EXITING set.)

Two rules are checked on every sample:
- never live copies on two nodes at once;
- never a live copy on one node while another node has a copy (dormant or not) that its records
  say it may still let run: an incoming hold (in-prepared, in-restoring, in-restored) whose
  deadline has not passed by the daemons' clock (CLOCK_BOOTTIME, shared by the lab's daemons).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from singularityd.federation.driver import boot_clock
from singularityd.federation.handoff import INCOMING
from tests.federation.lab import Lab, Node

RESTORE_LEAVING_STOPPED = (b"restore", b"--leave-stopped")
"""Arguments of a CRIU command line that restores tasks and leaves them stopped."""
PF_FLAGS_FIELD = 6
"""Index of the kernel's task flags among the fields of /proc/<pid>/stat after the command name."""
PF_EXITING = 0x4
SIGKILL_BIT = 1 << (signal.SIGKILL - 1)
SIGSTOP_BIT = 1 << (signal.SIGSTOP - 1)


def stored(node: Node, query: str, job: int | str) -> str | None:
    """One value a node's database holds for a job (read-only, never blocking the daemon)."""
    database = node.state_dir / "singularity.db"
    try:
        with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=1)) as db:
            row = db.execute(query, (job,)).fetchone()
    except sqlite3.Error:
        return None
    return str(row[0]) if row else None


def holding_of(node: Node, job: int) -> dict[str, object] | None:
    """A node's stored hand-off record of a job, as stored (JSON)."""
    text = stored(node, "SELECT holding FROM holdings WHERE job_id = ?", str(job))
    if not text:
        return None
    found: dict[str, object] = json.loads(text)
    return found


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (state first, then the parent)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _under_stopping_restore(pid: int) -> bool:
    """Whether an ancestor of `pid` is a CRIU restoring with --leave-stopped."""
    seen = set()
    parent = int(_stat_fields(pid)[1])
    while parent > 1 and parent not in seen:
        seen.add(parent)
        arguments = Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")
        if all(flag in arguments for flag in RESTORE_LEAVING_STOPPED):
            return True
        parent = int(_stat_fields(parent)[1])
    return False


def _dying_or_stopping(pid: int, stat: list[str]) -> bool:
    """Whether a process is exiting (PF_EXITING) or has a SIGKILL or SIGSTOP pending: it runs none
    of its code before it is gone or stopped."""
    if int(stat[PF_FLAGS_FIELD]) & PF_EXITING:
        return True
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & (SIGKILL_BIT | SIGSTOP_BIT):
            return True
    return False


def is_live(pid: int) -> bool:
    """Whether a process can execute its program's code now (see the module's docstring)."""
    try:
        stat = _stat_fields(pid)
        if stat[0] in "TtZX" or _dying_or_stopping(pid, stat):
            return False
        return not _under_stopping_restore(pid)
    except (OSError, IndexError, ValueError):
        return False  # gone meanwhile


@dataclass
class Copies:
    """One node's copies of a job."""

    live: int = 0
    dormant: int = 0


def copies_by_pid(marker: str, pids: list[int] | None = None) -> dict[int, bool]:
    """Each process whose command line holds `marker`, and whether it is live."""
    found = {}
    for pid in pids if pids is not None else [int(e) for e in os.listdir("/proc") if e.isdigit()]:
        with contextlib.suppress(OSError):
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found[pid] = is_live(pid)
    return found


class Referee:
    """Watches every process in /proc while a trial's job is set (`watch`) and records violations."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.marker = ""
        self.job: int | None = None
        self.violations: list[str] = []
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def watch(self, marker: str, job: int | None) -> None:
        """Referee the job whose processes carry `marker` ('' stops refereeing)."""
        self.job = job
        self.marker = marker

    def _node_of(self) -> dict[int, str]:
        """Each node's name by the inode of its network namespace, where its jobs run."""
        inodes = {}
        for node in self.lab.nodes.values():
            with contextlib.suppress(OSError):
                inodes[os.stat(node.network_pin).st_ino] = node.name
        return inodes

    def copies(self, marker: str) -> dict[str, Copies]:
        """The copies of the job with `marker` on each node that has any."""
        nodes = self._node_of()
        found: dict[str, Copies] = collections.defaultdict(Copies)
        for pid, live in copies_by_pid(marker).items():
            with contextlib.suppress(OSError):
                node = nodes.get(os.stat(f"/proc/{pid}/ns/net").st_ino)
                if node is None:
                    continue
                if live:
                    found[node].live += 1
                else:
                    found[node].dormant += 1
        return dict(found)

    def live_copies(self, marker: str) -> dict[str, int]:
        """The number of live copies on each node that has one."""
        return {node: seen.live for node, seen in self.copies(marker).items() if seen.live}

    def problem(self, marker: str, job: int | None) -> str:
        """What is wrong with the copies of the job now ('' when nothing is)."""
        copies = self.copies(marker)
        live = sorted(node for node, seen in copies.items() if seen.live)
        if len(live) > 1:
            return f"{marker}: live on {live}"
        if not live or job is None:
            return ""
        for node, seen in copies.items():
            if node == live[0]:
                continue
            holding = holding_of(self.lab.node(node), job)
            if holding is None or holding["phase"] not in INCOMING:
                continue
            if boot_clock() <= float(str(holding["deadline"])):
                why = f"holds a copy ({seen}) it may let run: {holding}"
                return f"{marker}: live on {live[0]} while {node} {why}"
        return ""

    def _watch(self) -> None:
        while not self._stop.is_set():
            marker, job = self.marker, self.job
            if marker:
                problem = self.problem(marker, job)
                self.samples += 1
                if problem:
                    self.violations.append(problem)
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop watching."""
        self._stop.set()
        self._thread.join(10)
