"""Jobs of other users in user namespaces owned by root: pure checks first, then real CRIU.

Where root lacks CAP_SYS_RESOURCE, CRIU cannot read another user's limits; a job whose init is root
of a user namespace that root created (identity-mapped ids, own PID and mount namespaces, a /proc
of its own) can be dumped and restored all the same. These tests start jobs through the real
launcher (singularityd/jobs/launcher.py) and checkpoint them through the real Checkpointer.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from singularityd.checkpoint import Checkpointer, CheckpointError, Criu, CriuInfo, ImageStore, Manifest
from singularityd.checkpoint.manifest import ManifestError
from singularityd.checkpoint.namespaces import (
    MountEntry,
    external_mount_names,
    parse_mountinfo,
    read_external_mounts,
    user_namespace_of,
)
from singularityd.checkpoint.precheck import DaemonFacts, ProcFacts, tree_problems
from singularityd.jobs import launcher
from singularityd.jobs.launch import probe_user_namespaces
from tests.checkpoint_helpers import children, kill_tree, pid_alive, wait_exit, wait_for_line
from tests.helpers import ensure_user, python_for_user

ROOT = os.geteuid() == 0
USER = "sing-test-job"
IDENTITY = ["0", "0", "4294967295"]

# ---------------------------------------------------------------- pure logic

MOUNTINFO = """\
64 63 254:0 / / rw,relatime - ext4 /dev/vda rw
66 64 0:22 / /sys rw,relatime - sysfs sysfs rw
67 66 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw
78 64 0:6 / /dev rw,relatime - devtmpfs devtmpfs rw
79 78 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw
80 79 0:27 / /dev/shm rw,relatime - tmpfs tmpfs rw
90 64 254:0 /srv/data /data rw,relatime shared:3 - ext4 /dev/vda rw
83 64 0:39 / /proc rw,nosuid - proc proc rw
"""
OURS = """\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
22 27 0:21 / /proc rw,relatime - proc proc rw
23 27 0:22 / /sys rw,relatime - sysfs sysfs rw
47 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw
24 27 0:6 / /dev rw,relatime - devtmpfs devtmpfs rw
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw
26 25 0:27 / /dev/shm rw,relatime - tmpfs tmpfs rw
91 27 254:0 /srv/data /data rw,relatime shared:3 - ext4 /dev/vda rw
"""


def test_external_mounts_are_the_ones_shared_with_the_daemon() -> None:
    job = parse_mountinfo(MOUNTINFO)
    assert job[0] == MountEntry(64, "254:0", "/", "/", "ext4")
    assert job[-1].fstype == "proc" and job[-1].mount_point == "/proc"
    names = external_mount_names(job, parse_mountinfo(OURS))
    assert names == {"m0": "/sys", "m1": "/sys/fs/cgroup", "m2": "/dev", "m3": "/dev/shm", "m4": "/data"}
    assert "/proc" not in names.values(), "the job's own /proc is CRIU's to recreate"
    odd = [*job, MountEntry(99, "0:23", "/", "/mnt/with\\040space", "tmpfs")]
    with pytest.raises(ValueError, match="cannot be named"):
        external_mount_names(odd, parse_mountinfo(OURS))


def _proc(
    pid: int, uid: int, *, userns: int, netns: int = 5, sockets: tuple[int, ...] = (), **kw: object
) -> ProcFacts:
    nspid = (pid, 1) if uid == 0 else (pid, 3)
    targets = tuple(f"socket:[{s}]" for s in sockets)
    return ProcFacts(pid, "python", (uid,) * 4, (uid,) * 4, nspid, targets, userns=userns, netns=netns, **kw)  # type: ignore[arg-type]


def test_tree_in_an_owned_user_namespace_needs_no_cap_sys_resource() -> None:
    init, rank = _proc(10, 0, userns=2), _proc(11, 1000, userns=2)
    owned = DaemonFacts(uid=0, gid=0, have_cap_sys_resource=False, userns=1, netns=5, root_userns_owned=True)
    assert tree_problems([init, rank], owned, tcp_problem_text="") == []
    foreign = DaemonFacts(uid=0, gid=0, have_cap_sys_resource=False, userns=1, netns=5)
    assert "not created by this daemon" in tree_problems([init, rank], foreign, tcp_problem_text="")[0]
    nested = _proc(12, 1000, userns=3)
    problems = tree_problems([init, rank, nested], owned, tcp_problem_text="")
    assert problems == [
        "process 12 (python) entered a user namespace of its own, which CRIU cannot checkpoint"
    ]
    in_host = DaemonFacts(
        uid=0, gid=0, have_cap_sys_resource=False, userns=1, netns=5, root_userns_owned=True
    )
    talking = _proc(
        11, 1000, userns=2, sockets=(70, 71), tcp_inodes=frozenset({70, 71}), tcp_connected=frozenset({71})
    )
    (problem,) = tree_problems([init, talking], in_host, tcp_problem_text="")
    assert "TCP connections" in problem and 'job_network = "private"' in problem
    listening = _proc(11, 1000, userns=2, sockets=(70,), tcp_inodes=frozenset({70}))
    assert tree_problems([init, listening], in_host, tcp_problem_text="") == []
    private_init = _proc(10, 0, userns=2, netns=6)
    private_rank = _proc(11, 1000, userns=2, netns=6, sockets=(71,), tcp_connected=frozenset({71}))
    assert tree_problems([private_init, private_rank], in_host, tcp_problem_text="") == []


def test_manifest_keeps_external_mounts() -> None:
    base = Manifest("j", 1, 1.0, 1000, False, "4.2.1", {})
    for mounts in (None, {}, {"m0": "/sys", "m1": "/dev shm"}):
        m = Manifest(**{**base.__dict__, "external_mounts": mounts})
        assert Manifest.from_json(m.to_json()).external_mounts == mounts
    text = base.to_json().replace('"external_mounts": null', '"external_mounts": [1]')
    with pytest.raises(ManifestError, match="external_mounts"):
        Manifest.from_json(text)


def test_restore_of_a_job_with_its_own_mounts_runs_criu_in_a_mount_yard() -> None:
    info = CriuInfo(argv=("/usr/sbin/criu",), version=(4, 2, 1), source="test", dirty_tracking=False)
    criu = Criu(info)
    yard = Path("/state/logs/mount-yard")
    argv = criu.restore_argv(
        Path("/img"),
        log_file=Path("/l"),
        pidfile=Path("/p"),
        inherit_fds={},
        external_mounts={"m0": "/sys"},
        mount_yard=yard,
    )
    assert argv[:6] == [
        sys.executable,
        "-S",
        launcher.__file__,
        "--restore-mounts",
        str(yard),
        '{"m0": "/sys"}',
    ]
    assert argv[6:8] == ["/usr/sbin/criu", "restore"]
    assert argv[-3:] == ["--root", f"{yard}/root", f"--external=mnt[m0]:{yard}/m0"]
    plain = criu.restore_argv(Path("/img"), log_file=Path("/l"), pidfile=Path("/p"), inherit_fds={})
    assert plain[0] == "/usr/sbin/criu" and "--root" not in plain
    dump = criu.dump_argv(
        1, Path("/img"), log_file=Path("/l"), leave_running=True, external_mounts={"m0": "/sys"}
    )
    assert "--external=mnt[/sys]:m0" in dump


# ---------------------------------------------------------------- real jobs and real CRIU

needs_userns = pytest.mark.skipif(not ROOT, reason="needs root (user namespaces, CRIU)")


@pytest.fixture(scope="module")
def userns(criu_info: CriuInfo) -> CriuInfo:
    """The CRIU to use, once a trial has shown that jobs can run in user namespaces here."""
    problem = probe_user_namespaces()
    if problem:
        pytest.skip(f"user namespaces do not work here: {problem}")
    return criu_info


@dataclass
class Job:
    """A job started through the real launcher: its supervisor's host PID and its files."""

    pid: int
    logs: list[Path]
    status: Path


def start(
    work: Path, name: str, args: list[str], jobs: list[int], *, ranks: int = 1, network: bool = False
) -> Job:
    """Launch a Python job of USER in a user namespace, as the daemon would; RANK tells ranks apart."""
    account = ensure_user(USER)
    python = python_for_user(USER)
    if python is None:
        pytest.skip(f"no Python with this project importable by {USER} here")
    folder = work / name
    (folder / "logs").mkdir(parents=True)
    folder.chmod(0o711)
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "USE_LIBUV": "0", "PYTHONUNBUFFERED": "1"}
    logs = [folder / "logs" / f"rank-{r}.log" for r in range(ranks)]
    spec = {
        "job_id": 1,
        "uid": account.pw_uid,
        "gid": account.pw_gid,
        "user": USER,
        "groups": [account.pw_gid],
        "command": [*python, *args],
        "cwd": str(work),
        "rank_envs": [{**env, "RANK": str(r)} for r in range(ranks)],
        "rank_logs": [str(log) for log in logs],
        "supervisor_log": str(folder / "supervisor.log"),
        "status_path": str(folder / "status.json"),
        "pid_path": str(folder / "init.pid"),
        "pid_namespace": True,
        "user_namespace": True,
        "network_namespace": network,
        "kill_grace_seconds": 2,
    }
    spec_path = folder / "launch.json"
    spec_path.write_text(json.dumps(spec))
    out = subprocess.run(
        [sys.executable, "-S", launcher.__file__, str(spec_path)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout)
    jobs.append(pid)
    return Job(pid, logs, folder / "status.json")


def status_fields(pid: int) -> dict[str, str]:
    """The fields of /proc/PID/status."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def assert_in_own_user_namespace(init: int) -> None:
    """The job's init is root of an identity-mapped user namespace of ours; its ranks are the user's."""
    account = pwd.getpwnam(USER)
    userns = user_namespace_of(init)
    assert not userns.ours and userns.owned_by_us
    for name in ("uid_map", "gid_map"):
        assert Path(f"/proc/{init}/{name}").read_text().split() == IDENTITY
    assert status_fields(init)["Uid"].split() == ["0"] * 4
    assert status_fields(init)["NSpid"].split()[-1] == "1"
    ranks = children(init)
    assert ranks
    for rank in ranks:
        fields = status_fields(rank)
        assert fields["Uid"].split() == [str(account.pw_uid)] * 4
        assert fields["Gid"].split() == [str(account.pw_gid)] * 4
        assert fields["CapEff"] == fields["CapPrm"] == "0000000000000000"
        assert user_namespace_of(rank).inode == userns.inode


def run_to_end(job: Job) -> None:
    assert wait_exit(job.pid, 120), f"job {job.pid} did not finish"
    status = json.loads(job.status.read_text())
    assert status["exit_code"] == 0, status


@needs_userns
def test_launcher_probe_and_a_job_in_its_namespaces(userns: CriuInfo, work: Path, jobs: list[int]) -> None:
    """The job sees only its own processes in its /proc; the daemon's mounts are named external."""
    peek = "import os; print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()), os.getuid())"
    job = start(work, "peek", ["-c", f"{peek}; import time; time.sleep(30)"], jobs)
    assert wait_for_line(job.logs[0], "]", 30)
    assert_in_own_user_namespace(job.pid)
    pids, uid = job.logs[0].read_text().rsplit("]", 1)
    visible = [int(p) for p in pids.strip("[").split(",")]
    assert len(visible) == 2 and visible[0] == 1, f"only the init and the rank itself: {visible}"
    assert int(uid) == pwd.getpwnam(USER).pw_uid
    mounts = read_external_mounts(job.pid)
    assert mounts is not None and "/proc" not in mounts.values() and "/" not in mounts.values()
    assert read_external_mounts(os.getpid()) is None


@needs_userns
def test_another_users_torch_job_dumped_and_restored_exactly(
    userns: CriuInfo, work: Path, jobs: list[int]
) -> None:
    """In-place checkpoint, crash, preempt twice: byte-identical output, same maps, uid and caps."""
    script = Path(__file__).parent / "workloads" / "train_cpu.py"
    release = work / "release"
    command = [str(script), "--steps", "150", "--sleep", "0.02", "--hold", str(release)]
    reference = start(work, "reference", [str(script), "--steps", "150"], jobs)
    job = start(work, "train", command, jobs)
    assert wait_for_line(job.logs[0], "step 5 ", 60)
    assert_in_own_user_namespace(job.pid)
    account = pwd.getpwnam(USER)
    checkpointer = Checkpointer(Criu(userns), ImageStore(work / "store"))

    async def drive() -> int:
        pid = job.pid
        for leave_running in (True, False, False):
            await asyncio.sleep(0.3)
            result = await checkpointer.checkpoint(
                "train", pid, owner_uid=account.pw_uid, owner_gid=account.pw_gid,
                leave_running=leave_running, rewind_paths=[str(job.logs[0])],
            )  # fmt: skip
            assert result.manifest.external_mounts
            if leave_running:
                await asyncio.sleep(0.3)
                kill_tree(pid)
            assert wait_exit(pid, 10)
            restored = await checkpointer.restore_latest("train")
            pid = restored.pid
            jobs.append(pid)
            assert_in_own_user_namespace(pid)
        return pid

    job.pid = asyncio.run(drive())
    release.touch()
    run_to_end(job)
    run_to_end(reference)
    assert "final weights" in reference.logs[0].read_text()
    assert job.logs[0].read_bytes() == reference.logs[0].read_bytes()


PING_PONG = """
import socket, sys, time
import os
rank, port, rounds, hold = int(os.environ["RANK"]), int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if rank == 0:
    server = socket.create_server(("127.0.0.1", port))
    peer = server.accept()[0].makefile("rw")
else:
    for _ in range(200):
        try:
            peer = socket.create_connection(("127.0.0.1", port)).makefile("rw")
            break
        except OSError:
            time.sleep(0.05)
for i in range(rounds):
    if rank == 1:
        peer.write(f"{i}\\n"); peer.flush()
    got = int(peer.readline())
    if rank == 0:
        peer.write(f"{got * 2}\\n"); peer.flush()
    print(i, got, flush=True)
    time.sleep(0.02)
while not os.path.exists(hold):
    time.sleep(0.05)
print("done", flush=True)
"""


@needs_userns
@pytest.mark.parametrize("network", ["private", "host"])
def test_tcp_between_ranks(userns: CriuInfo, work: Path, jobs: list[int], network: str) -> None:
    """Ranks talking TCP on 127.0.0.1: restored exactly in a private network, refused in the host's."""
    if userns.tcp_problem:
        pytest.skip(userns.tcp_problem)
    script = work / "ping_pong.py"
    script.write_text(PING_PONG)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    rounds = "120"
    release = work / "release"
    job = start(
        work, "tcp", [str(script), port, rounds, str(release)], jobs, ranks=2, network=network == "private"
    )
    assert wait_for_line(job.logs[1], "5 10\n", 30)
    account = pwd.getpwnam(USER)
    checkpointer = Checkpointer(Criu(userns), ImageStore(work / "store"))
    checkpoint = checkpointer.checkpoint(
        "tcp", job.pid, owner_uid=account.pw_uid, owner_gid=account.pw_gid,
        leave_running=False, rewind_paths=[str(log) for log in job.logs],
    )  # fmt: skip
    if network == "host":
        with pytest.raises(CheckpointError, match="TCP connections"):
            asyncio.run(checkpoint)
        assert pid_alive(job.pid)
    else:
        asyncio.run(checkpoint)
        assert wait_exit(job.pid, 10)
        job.pid = asyncio.run(checkpointer.restore_latest("tcp")).pid
        jobs.append(job.pid)
        assert_in_own_user_namespace(job.pid)
    release.touch()
    run_to_end(job)
    n = int(rounds)
    assert job.logs[1].read_text() == "".join(f"{i} {2 * i}\n" for i in range(n)) + "done\n"
    assert job.logs[0].read_text() == "".join(f"{i} {i}\n" for i in range(n)) + "done\n"
