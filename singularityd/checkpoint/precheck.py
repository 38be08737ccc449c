"""What stops CRIU from dumping a job's process tree, found from /proc before CRIU freezes anything.

`tree_problems` is the pure judgement over facts about each process (`ProcFacts`) and the daemon
(`DaemonFacts`); `dump_problems` gathers those facts for a live tree. A plain function (quick
/proc reads): call it through `asyncio.to_thread`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from singularityd.checkpoint.criu_discovery import CriuInfo
from singularityd.checkpoint.namespaces import user_namespace_of

CAP_SYS_RESOURCE = 24


@dataclass(frozen=True)
class ProcFacts:
    """What /proc says about one process of a job's tree, for the pre-dump checks."""

    pid: int
    name: str
    uids: tuple[int, ...]
    gids: tuple[int, ...]
    nspid: tuple[int, ...]
    fd_targets: tuple[str, ...] = ()
    tcp_inodes: frozenset[int] = field(default_factory=frozenset)
    tcp_connected: frozenset[int] = field(default_factory=frozenset)
    userns: int = 0
    netns: int = 0

    @property
    def socket_inodes(self) -> set[int]:
        """Inodes of the sockets the process has open."""
        return {int(t[8:-1]) for t in self.fd_targets if t.startswith("socket:[") and t.endswith("]")}

    @property
    def holds_tcp(self) -> bool:
        """Whether the process has a TCP socket open, listening or connected (read with TCP facts)."""
        return bool(self.socket_inodes & self.tcp_inodes)


@dataclass(frozen=True)
class DaemonFacts:
    """What the pre-dump checks compare a job's processes with: the daemon's own standing."""

    uid: int
    gid: int
    have_cap_sys_resource: bool
    userns: int = 0
    netns: int = 0
    root_userns_owned: bool = False
    userns_problem: str = ""


def tree_problems(procs: Sequence[ProcFacts], daemon: DaemonFacts, *, tcp_problem_text: str) -> list[str]:
    """Reasons a tree cannot be dumped, found before CRIU freezes anything (pure).

    `daemon.root_userns_owned` says whether the root's user namespace, when not the daemon's, is
    one the daemon created (then CRIU holds every capability over the tree).
    """
    problems: list[str] = []
    if not procs:
        return ["the job's root process does not exist"]
    root = procs[0]
    if len(root.nspid) > 1 and root.nspid[-1] == 1 and 0 not in root.uids[1:2]:
        problems.append(
            f"the job's PID-namespace init (pid {root.pid}) runs as uid {root.uids[1]}: "
            "CRIU needs it to be root (only the ranks should drop privileges)"
        )
    if root.userns != daemon.userns:
        problems += _user_namespace_problems(procs, daemon)
    elif not daemon.have_cap_sys_resource:
        foreign = [
            p for p in procs if any(u != daemon.uid for u in p.uids) or any(g != daemon.gid for g in p.gids)
        ]
        if foreign:
            p = foreign[0]
            why_not = f" ({daemon.userns_problem})" if daemon.userns_problem else ""
            problems.append(
                f"process {p.pid} ({p.name}) runs as uid {p.uids[0]} and this daemon lacks "
                f"CAP_SYS_RESOURCE, without which CRIU cannot read another user's limits{why_not}"
            )
    for p in procs:
        if any("io_uring" in t for t in p.fd_targets):
            problems.append(
                f"process {p.pid} ({p.name}) uses io_uring, which CRIU cannot checkpoint "
                "(for torch.distributed set USE_LIBUV=0 so its TCPStore and RPC do not use libuv, "
                "and name no 'uv' transport or 'mpt_uv' channel in TensorPipeRpcBackendOptions)"
            )
            break
    if tcp_problem_text:
        for p in procs:
            if p.holds_tcp:
                problems.append(f"process {p.pid} ({p.name}) has TCP sockets: {tcp_problem_text}")
                break
    return problems


def _user_namespace_problems(procs: Sequence[ProcFacts], daemon: DaemonFacts) -> list[str]:
    """What stops CRIU from checkpointing a tree whose root is in a user namespace (pure)."""
    root = procs[0]
    if not daemon.root_userns_owned:
        return [f"the job's user namespace (of pid {root.pid}) was not created by this daemon"]
    problems = []
    nested = [p for p in procs if p.userns != root.userns]
    if nested:
        p = nested[0]
        problems.append(
            f"process {p.pid} ({p.name}) entered a user namespace of its own, which CRIU cannot checkpoint"
        )
    if root.netns == daemon.netns:
        for p in procs:
            if p.socket_inodes & p.tcp_connected:
                problems.append(
                    f"process {p.pid} ({p.name}) has TCP connections, which CRIU cannot restore into "
                    "the host's network from the job's user namespace (TCP repair needs CAP_NET_ADMIN "
                    'there); give jobs a network of their own (job_network = "private")'
                )
                break
    return problems


def tree_pids(root: int) -> list[int]:
    """Host PIDs of a process and all its descendants, root first."""
    out = [root]
    i = 0
    while i < len(out):
        pid = out[i]
        i += 1
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
                    out.extend(int(c) for c in children if int(c) not in out)
    return out


def signal_tree(pid: int, sig: int, sparing: Collection[int] = ()) -> None:
    """Send a signal to a process and all its descendants, but for those whose PID in their own
    namespace (the last of NSpid) is in `sparing`."""
    for each in tree_pids(pid):
        if sparing and namespace_pid(each) in sparing:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, sig)


def namespace_pid(pid: int) -> int | None:
    """The process's PID in its own PID namespace (None when it is gone)."""
    try:
        nspid = status_fields(Path(f"/proc/{pid}/status").read_text()).get("NSpid", "").split()
    except OSError:
        return None
    return int(nspid[-1]) if nspid else None


TCP_LISTEN = 0x0A
TCP_CLOSE = 0x07


def _tcp_inodes(pid: int) -> tuple[frozenset[int], frozenset[int]]:
    """Inodes of the TCP sockets in the process's network namespace: all, and those connected."""
    inodes: set[int] = set()
    connected: set[int] = set()
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]:
                cols = line.split()
                if len(cols) > 9 and cols[9].isdigit():
                    inodes.add(int(cols[9]))
                    if int(cols[3], 16) not in (TCP_LISTEN, TCP_CLOSE):
                        connected.add(int(cols[9]))
    return frozenset(inodes), frozenset(connected)


def tree_holds_tcp(pids: Sequence[int]) -> bool:
    """Whether any of these processes has a TCP socket open (listening or connected): what CRIU's
    network lock guards."""
    for pid in pids:
        facts = read_proc_facts(pid, with_tcp=True)
        if facts is not None and facts.holds_tcp:
            return True
    return False


def status_fields(status: str) -> dict[str, str]:
    """The fields of a /proc/PID/status text by name, their values stripped (pure)."""
    fields: dict[str, str] = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def read_proc_facts(pid: int, *, with_tcp: bool) -> ProcFacts | None:
    """Facts about one process from /proc, or None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        userns = os.stat(f"/proc/{pid}/ns/user").st_ino
        netns = os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None
    fields = status_fields(status)
    targets: list[str] = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    tcp, connected = _tcp_inodes(pid) if with_tcp else (frozenset[int](), frozenset[int]())
    return ProcFacts(
        pid=pid,
        name=fields.get("Name", "?"),
        uids=tuple(int(x) for x in fields.get("Uid", "0").split()),
        gids=tuple(int(x) for x in fields.get("Gid", "0").split()),
        nspid=tuple(int(x) for x in fields.get("NSpid", str(pid)).split()),
        fd_targets=tuple(targets),
        tcp_inodes=tcp,
        tcp_connected=connected,
        userns=userns,
        netns=netns,
    )


def have_capability(cap: int) -> bool:
    """Whether this process has capability number `cap` in its effective set."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> cap & 1)
    return False


def dump_problems(pid: int, info: CriuInfo, userns_problem: str = "") -> list[str]:
    """Reasons the tree rooted at `pid` cannot be dumped, checked before CRIU touches it.

    `userns_problem` says why jobs do not run in user namespaces here, if they do not.
    """
    try:
        userns = user_namespace_of(pid)
        in_host_network = os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return ["the job's root process does not exist"]
    with_tcp = bool(info.tcp_problem) or (not userns.ours and in_host_network)
    facts = [read_proc_facts(p, with_tcp=with_tcp) for p in tree_pids(pid)]
    daemon = DaemonFacts(
        uid=os.getuid(),
        gid=os.getgid(),
        have_cap_sys_resource=have_capability(CAP_SYS_RESOURCE),
        userns=os.stat("/proc/self/ns/user").st_ino,
        netns=os.stat("/proc/self/ns/net").st_ino,
        root_userns_owned=userns.owned_by_us,
        userns_problem=userns_problem,
    )
    return tree_problems([f for f in facts if f is not None], daemon, tcp_problem_text=info.tcp_problem)
