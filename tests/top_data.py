"""Fixed data and a frozen clock for the snapshot tests of `sing top`.

`FixedSource` implements the app's DataSource with messages built here, so the picture depends
on nothing but this file: it stands in for the daemon only where a picture must not change from
run to run. The Pilot tests drive the app against a real daemon instead.
"""

from __future__ import annotations

from collections.abc import Iterator

from singularity.cli.errors import EXIT_UNAVAILABLE, CliError
from singularity.cli.source import Snapshot
from singularityd.api.v1 import singularity_pb2 as pb

NOW = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC
GIB = 1024**3


def _checkpoint(seq: int, age: float, size: int, pause: float) -> pb.CheckpointInfo:
    """A complete checkpoint taken `age` seconds before NOW."""
    return pb.CheckpointInfo(seq=seq, created_at=NOW - age, bytes=size, complete=True, pause_seconds=pause)


def _job(job_id: int, name: str, user: str, state: str, **fields: object) -> pb.Job:
    """A job message with sensible defaults and the given fields."""
    job = pb.Job(
        id=job_id,
        name=name,
        user=user,
        uid=1000 + job_id,
        state=state,
        command=["python", f"{name}.py"],
        cwd=f"/home/{user}",
        ranks=1,
        gpus=1,
        attempt=1,
        tier="standard",
        submitted_at=NOW - 3600 - job_id * 60,
    )
    for key, value in fields.items():
        if key == "last_checkpoint":
            assert isinstance(value, pb.CheckpointInfo)
            job.last_checkpoint.CopyFrom(value)
        elif key == "devices":
            assert isinstance(value, list)
            job.devices.extend(value)
        else:
            setattr(job, key, value)
    return job


JOBS = [
    _job(12, "train-llm", "alice", "RUNNING", priority=10, gpus=2, ranks=4, devices=[0, 1],
         started_at=NOW - 3000, reason="restored from checkpoint 6", cpu_seconds=11520.0,
         rss_bytes=6 * GIB, checkpoints=2, checkpoint_bytes=int(3.8 * GIB), checkpoint_interval=600.0,
         attempt=3, last_checkpoint=_checkpoint(7, 240, int(1.9 * GIB), 0.84)),
    _job(15, "finetune", "bob", "RUNNING", devices=[2], started_at=NOW - 1200,
         reason="started on devices 2", cpu_seconds=1150.0, rss_bytes=2 * GIB),
    _job(17, "eval-sweep", "carol", "PREEMPTED", priority=-5, tier="basic", gpus=2, started_at=NOW - 2400,
         reason="preempted for job 21, which outranks it", pending_reason="Priority: queued behind job 21",
         checkpoints=1, checkpoint_bytes=512 * 1024**2, attempt=1,
         last_checkpoint=_checkpoint(1, 600, 512 * 1024**2, 0.31)),
    _job(19, "notebook", "dave", "SUSPENDED", started_at=NOW - 5000, reason="suspended by dave",
         checkpoints=1, checkpoint_bytes=80 * 1024**2,
         last_checkpoint=_checkpoint(1, 1800, 80 * 1024**2, 0.05)),
    _job(21, "big-run", "alice", "PENDING", priority=20, tier="premium", gpus=4, ranks=8,
         reason="submitted", pending_reason="Resources: needs 4 devices, 0 free"),
    _job(22, "resnet", "bob", "RUNNING", devices=[3], started_at=NOW - 900, starting=True, checkpoints=1,
         checkpoint_bytes=300 * 1024**2, attempt=2, reason="started on devices 3",
         last_checkpoint=_checkpoint(1, 30, 300 * 1024**2, 0.12)),
]  # fmt: skip
ENDED = [
    _job(9, "smoke-test", "alice", "COMPLETED", started_at=NOW - 7000, ended_at=NOW - 6900,
         reason="exited with code 0", exit_code=0),
    _job(10, "typo", "carol", "FAILED", started_at=NOW - 6800, ended_at=NOW - 6799,
         reason="exited with code 1", exit_code=1),
]  # fmt: skip


def _device(
    index: int, util: float, used_gib: float, sessions: list[tuple[int, int, float, bool]]
) -> pb.Device:
    """An NVIDIA-like device with the given (job, rank, GiB, connected) sessions."""
    device = pb.Device(
        index=index,
        kind="nvml",
        name="NVIDIA H100 80GB HBM3",
        uuid=f"GPU-0000000{index}",
        memory_total=80 * GIB,
        memory_used=int(used_gib * GIB),
        utilization_percent=util,
        proxy="up",
    )
    for job, rank, held, connected in sessions:
        device.sessions.append(
            pb.DeviceSession(job=job, rank=rank, bytes=int(held * GIB), connected=connected)
        )
    device.jobs.extend(sorted({job for job, *_ in sessions}))
    return device


DEVICES = [
    _device(0, 97.0, 71.5, [(12, 0, 35.0, True), (12, 1, 35.5, True)]),
    _device(1, 88.0, 69.0, [(12, 2, 34.0, True), (12, 3, 34.5, True)]),
    _device(2, 41.0, 22.0, [(15, 0, 21.0, True)]),
    _device(3, 0.0, 9.0, [(22, 0, 9.0, False)]),
]

PEERS = pb.ListPeersResponse(
    node="node-a",
    node_number=1,
    peers=[
        pb.Peer(node="node-b", address="10.77.0.2:9471", state="alive", devices=4, free=3, version="0.1.0",
                last_contact=NOW - 1.5),
        pb.Peer(node="node-c", address="10.77.0.3:9471", state="alive", devices=2, free=0, version="0.1.0",
                last_contact=NOW - 0.8, draining=True),
        pb.Peer(node="node-d", address="10.77.0.4:9471", state="dead", devices=8, free=8, version="0.1.0",
                last_contact=NOW - 312, error="connection refused"),
    ],
)  # fmt: skip

INFO = pb.DaemonInfo(
    version="0.1.0",
    mode="system",
    socket="/run/singularity/sing.sock",
    device_kind="nvml",
    device_count=4,
    started_at=NOW - 86400 - 3723,
)

EVENTS = [
    (NOW - 3600 - 720, "", "PENDING", "submitted by alice"),
    (NOW - 3000, "PENDING", "RUNNING", "started on devices 0,1"),
    (NOW - 1800, "RUNNING", "RUNNING", "periodic checkpoint: checkpoint 5 (1.9G, paused 0.81s)"),
    (
        NOW - 1500,
        "RUNNING",
        "PREEMPTED",
        "preempted for job 21, which outranks it: checkpoint 6 (1.9G, paused 0.86s)",
    ),
    (NOW - 1200, "PREEMPTED", "RUNNING", "started on devices 0,1"),
    (NOW - 1190, "RUNNING", "RUNNING", "restored from checkpoint 6"),
    (NOW - 240, "RUNNING", "RUNNING", "periodic checkpoint: checkpoint 7 (1.9G, paused 0.84s)"),
]
LOG = "".join(f"step {step:5d}  loss {2.5 / (1 + step / 400):.4f}\n" for step in range(1180, 1200))


class FixedLog:
    """A log that is all there at once and then ends."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __iter__(self) -> Iterator[bytes]:
        yield self.text.encode()

    def cancel(self) -> None:
        """Nothing to stop."""


class FixedSource:
    """The DataSource of the snapshot tests: the data above, the clock stopped at NOW."""

    def __init__(self, *, reachable: bool = True, peers: bool = False) -> None:
        self.reachable = reachable
        self.peers = PEERS if peers else pb.ListPeersResponse()
        self.actions: list[tuple[str, int, str]] = []

    def where(self) -> str:
        """A socket path that is the same everywhere."""
        return "/run/singularity/sing.sock"

    def now(self) -> float:
        """The frozen clock."""
        return NOW

    def snapshot(self, all_jobs: bool) -> Snapshot:
        """The fixed jobs (with two ended ones when all_jobs) and devices."""
        if not self.reachable:
            raise CliError(
                "cannot reach singularityd at /run/singularity/sing.sock (nothing is listening)",
                EXIT_UNAVAILABLE,
            )
        jobs = [*(ENDED if all_jobs else []), *JOBS]
        return Snapshot(info=INFO, jobs=jobs, devices=DEVICES, peers=self.peers)

    def job_detail(self, job_id: int) -> pb.JobDetail:
        """Every job has the same timeline and checkpoints, under its own header."""
        job = next(j for j in [*JOBS, *ENDED] if j.id == job_id)
        detail = pb.JobDetail(job=job, log_path=f"/var/lib/singularity/jobs/{job_id}/logs/rank-0.log")
        for at, before, after, reason in EVENTS:
            detail.events.append(pb.Event(at=at, from_state=before, to_state=after, reason=reason))
        if job.HasField("last_checkpoint"):
            detail.checkpoint_list.extend([_checkpoint(6, 1500, int(1.9 * GIB), 0.86), job.last_checkpoint])
        return detail

    def follow_log(self, job_id: int, rank: int) -> FixedLog:
        """The same training log for every job."""
        return FixedLog(LOG)

    def act(self, action: str, job_id: int, target: str = "") -> str:
        """Record the action; say it happened."""
        self.actions.append((action, job_id, target))
        return f"job {job_id}: {action} done"
