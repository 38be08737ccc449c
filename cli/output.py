"""Rendering API messages for people (tables, timelines) and for programs (JSON)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from singularityd.api.v1 import singularity_pb2 as pb
from singularityd.units import human_bytes


def duration(seconds: float) -> str:
    """Elapsed time as squeue shows it: M:SS, H:MM:SS or D-HH:MM:SS."""
    seconds = max(0, int(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"
    if hours:
        return f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{minutes}:{secs:02d}"


def ago(at: float, now: float) -> str:
    """How long before `now` a moment was ('3:05 ago'), or 'never' when it is unset (0)."""
    return f"{duration(now - at)} ago" if at else "never"


def run_time(job: pb.Job, now: float) -> float:
    """How long the job has run (so far, or in total)."""
    if not job.started_at:
        return 0.0
    return (job.ended_at or now) - job.started_at


def timestamp(at: float) -> str:
    """A local timestamp, or '-' for unset."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if at else "-"


def job_dict(job: pb.Job) -> dict[str, Any]:
    """A job as plain JSON-friendly data (numbers stay numbers, unset times are null)."""
    return {
        "id": job.id,
        "name": job.name,
        "user": job.user,
        "uid": job.uid,
        "state": job.state,
        "reason": job.reason,
        "pending_reason": job.pending_reason or None,
        "priority": job.priority,
        "tier": job.tier,
        "gpus": job.gpus,
        "ranks": job.ranks,
        "devices": list(job.devices),
        "command": list(job.command),
        "cwd": job.cwd,
        "submitted_at": job.submitted_at or None,
        "started_at": job.started_at or None,
        "ended_at": job.ended_at or None,
        "exit_code": job.exit_code if job.HasField("exit_code") else None,
        "signal": job.signal if job.HasField("signal") else None,
        "cpu_seconds": job.cpu_seconds,
        "rss_bytes": job.rss_bytes,
        "attempt": job.attempt,
        "max_restarts": job.max_restarts,
        "min_gpus": job.min_gpus,
        "max_gpus": job.max_gpus,
        "splice_refusal": job.splice_refusal or None,
        "restarts_used": job.restarts_used,
        "checkpoint_interval": job.checkpoint_interval,
        "checkpoints": job.checkpoints,
        "checkpoint_bytes": job.checkpoint_bytes,
        "last_checkpoint": checkpoint_dict(job.last_checkpoint) if job.HasField("last_checkpoint") else None,
        "starting": job.starting,
        "node": job.node or None,
        "move": move_dict(job.move) if job.HasField("move") else None,
    }


def move_dict(move: pb.MoveInfo) -> dict[str, Any]:
    """A job's move to a peer as plain JSON-friendly data."""
    return {
        "peer": move.peer,
        "phase": move.phase,
        "moved": move.moved,
        "total": move.total,
        "sent": move.sent,
    }


def move_text(peer: str, phase: str, moved: int, total: int) -> str:
    """'sending to node-b: 45% (450.0 MiB of 1.0 GiB)', or the phase alone before bytes flow."""
    text = f"{phase} to {peer}" if phase != "done" else f"moved to {peer}"
    if total and phase == "sending":
        text += f": {100 * moved // total}% ({human_bytes(moved)} of {human_bytes(total)})"
    return text


def checkpoint_dict(checkpoint: pb.CheckpointInfo) -> dict[str, Any]:
    """A checkpoint as plain JSON-friendly data."""
    return {
        "seq": checkpoint.seq,
        "created_at": checkpoint.created_at or None,
        "bytes": checkpoint.bytes,
        "complete": checkpoint.complete,
        "pause_seconds": checkpoint.pause_seconds,
        "complete_seconds": checkpoint.complete_seconds,
        "stopped": checkpoint.stopped,
        "precopied_bytes": checkpoint.precopied_bytes,
        "paused_bytes": checkpoint.paused_bytes,
    }


def device_dict(device: pb.Device) -> dict[str, Any]:
    """A device as plain JSON-friendly data."""
    return {
        "index": device.index,
        "kind": device.kind,
        "name": device.name,
        "uuid": device.uuid,
        "memory_total": device.memory_total,
        "memory_used": device.memory_used,
        "utilization_percent": (
            device.utilization_percent if device.HasField("utilization_percent") else None
        ),
        "jobs": list(device.jobs),
        "proxy": device.proxy or None,
        "sessions": [
            {"job": x.job, "rank": x.rank, "bytes": x.bytes, "connected": x.connected}
            for x in device.sessions
        ],
    }


def to_json(data: Any) -> str:
    """Indented JSON, the form `-o json` prints."""
    return json.dumps(data, indent=2, sort_keys=False)


_CONTROL = {code: f"\\x{code:02x}" for code in [*range(32), 127]} | {9: "\\t", 10: "\\n", 13: "\\r"}
"""Control characters as a table cell shows them (a job name holding a newline broke its row)."""


def table(rows: Sequence[Sequence[str]], header: Sequence[str] | None) -> str:
    """Left-aligned columns separated by two spaces; the last column is not padded; control
    characters in a cell are shown escaped, so every row is one line."""
    all_rows = [list(header)] if header else []
    all_rows += [[cell.translate(_CONTROL) for cell in r] for r in rows]
    if not all_rows:
        return ""
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(all_rows[0]))]
    lines = []
    for row in all_rows:
        cells = [cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])] + [row[-1]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def devices_or_reason(job: pb.Job) -> str:
    """squeue's NODELIST(REASON) column: the devices of a running job, else why it waits/ended."""
    if job.devices and job.state in ("RUNNING", "MIGRATING"):
        return ",".join(str(d) for d in job.devices)
    if job.pending_reason:
        return f"({job.pending_reason})"
    return f"({job.reason})" if job.reason else ""


JOB_HEADER = ("ID", "NAME", "USER", "STATE", "TIER", "PRI", "GPUS", "TIME", "DEVICES(REASON)")
WIDE_HEADER = (
    "ID", "NAME", "USER", "STATE", "TIER", "PRI", "GPUS", "RANKS", "TIME", "CPU", "RSS", "EXIT",
    "SUBMITTED", "CKPTS", "CKPT-AGE", "CKPT-SIZE", "CKPT-PAUSE", "COMMAND", "DEVICES(REASON)",
)  # fmt: skip


def last_checkpoint_cells(job: pb.Job, now: float) -> list[str]:
    """The age, size and pause of the job's newest checkpoint, '-' each when it has none."""
    if not job.HasField("last_checkpoint"):
        return ["-", "-", "-"]
    last = job.last_checkpoint
    return [duration(now - last.created_at), human_bytes(last.bytes), f"{last.pause_seconds:.2f}s"]


def exit_text(job: pb.Job) -> str:
    """'0', '1', 'SIG9' or '-'."""
    if job.HasField("signal"):
        return f"SIG{job.signal}"
    if job.HasField("exit_code"):
        return str(job.exit_code)
    return "-"


MOVED = "MOVED"
"""The state of a job on the node it left for a peer."""
ENDED_STATES = ("COMPLETED", "FAILED", "CANCELLED", MOVED)
"""States of a job that will hold no device again here."""


def gpus_cell(job: pb.Job) -> str:
    """A job's devices for `sing ps`: how many it holds now (else asks for), with an elastic job's
    range, e.g. '2 (1-4)'."""
    count = len(job.devices) or job.gpus
    return f"{count} ({job.min_gpus}-{job.max_gpus})" if job.max_gpus else str(count)


def devices_text(job: pb.Job) -> str:
    """A job's devices for `sing show`, as Slurm and kubectl users read them: how many it holds now,
    its elastic range, and which, e.g. '2 (elastic 1-4; 4 ranks share them): 0,1'; a job holding
    none says how many it waits for, or ran on last."""
    elastic = [f"elastic {job.min_gpus}-{job.max_gpus}"] if job.max_gpus else []
    count = len(job.devices) or job.gpus
    shared = [f"{job.ranks} ranks share them"] if 0 < count < job.ranks else []
    if not job.devices:
        wanted = f"ran on {count}" if job.state in ENDED_STATES else f"waits for {count}"
        return f"none held ({'; '.join([wanted, *elastic, *shared])})"
    notes = f" ({'; '.join([*elastic, *shared])})" if elastic or shared else ""
    return f"{count}{notes}: {','.join(map(str, job.devices))}"


def job_row(job: pb.Job, wide: bool, now: float) -> list[str]:
    """One line of `sing ps`."""
    if not wide:
        return [
            str(job.id), job.name, job.user, job.state, job.tier, str(job.priority), gpus_cell(job),
            duration(run_time(job, now)), devices_or_reason(job),
        ]  # fmt: skip
    return [
        str(job.id), job.name, job.user, job.state, job.tier, str(job.priority), gpus_cell(job),
        str(job.ranks), duration(run_time(job, now)), f"{job.cpu_seconds:.1f}s",
        human_bytes(job.rss_bytes), exit_text(job), timestamp(job.submitted_at), str(job.checkpoints),
        *last_checkpoint_cells(job, now), " ".join(job.command), devices_or_reason(job),
    ]  # fmt: skip


def jobs_table(jobs: Sequence[pb.Job], wide: bool, header: bool, nodes: bool = False) -> str:
    """The `sing ps` table (with each job's node first for `sing ps --cluster`)."""
    now = time.time()
    rows = [([j.node] if nodes else []) + job_row(j, wide, now) for j in jobs]
    names = WIDE_HEADER if wide else JOB_HEADER
    return table(rows, ((("NODE",) if nodes else ()) + names) if header else None)


def job_detail_text(detail: pb.JobDetail, wide: bool = False, header: bool = True) -> str:
    """`sing show`: the spec, devices, status, each checkpoint with its pause, then the events."""
    job = detail.job
    now = time.time()
    lines = [
        f"Job:        {job.id} ({job.name})",
        f"User:       {job.user} (uid {job.uid})",
        f"State:      {job.state}",
        f"Reason:     {job.reason}",
    ]
    if job.pending_reason:
        lines.append(f"Pending:    {job.pending_reason}")
    if job.HasField("move"):
        move = job.move
        lines.append(f"Moving:     {move_text(move.peer, move.phase, move.moved, move.total)}")
    lines += [
        f"Command:    {' '.join(job.command)}",
        f"Directory:  {job.cwd}",
        f"Tier:       {job.tier}",
        f"Priority:   {job.priority}",
        f"Devices:    {devices_text(job)}",
        f"Ranks:      {job.ranks}",
        *([f"Splicing:   refused, one device per rank ({job.splice_refusal})"] if job.splice_refusal else []),
        f"Submitted:  {timestamp(job.submitted_at)}",
        f"Started:    {timestamp(job.started_at)}",
        f"Ended:      {timestamp(job.ended_at)}",
        f"Run time:   {duration(run_time(job, now))}",
        f"Attempts:   {job.attempt}",
        f"Restarts:   {job.restarts_used}/{job.max_restarts}",
        f"Exit:       {exit_text(job)}",
        f"CPU time:   {job.cpu_seconds:.2f}s",
        f"Memory:     {human_bytes(job.rss_bytes)}" + (" (peak)" if job.ended_at else " (resident)"),
    ]
    interval = f"every {job.checkpoint_interval:g}s" if job.checkpoint_interval else "on demand only"
    lines.append(
        f"Checkpoints: {job.checkpoints} kept, {human_bytes(job.checkpoint_bytes)} on disk ({interval})"
    )
    if job.HasField("last_checkpoint"):
        age, size, pause = last_checkpoint_cells(job, now)
        lines.append(f"Last:       checkpoint {job.last_checkpoint.seq}, {age} ago, {size}, paused {pause}")
    if detail.checkpoint_list:
        lines += [
            "  " + line for line in checkpoints_table(detail.checkpoint_list, wide, header).splitlines()
        ]
    if detail.log_path:
        lines.append(f"Log:        {detail.log_path}")
    if detail.env:
        lines.append(f"Env:        {len(detail.env)} variables (see -o json)")
    lines.append("")
    lines.append("Events:")
    rows = [[timestamp(e.at), _transition_text(e), e.reason] for e in detail.events]
    lines += [
        "  " + line for line in table(rows, ("TIME", "STATE", "EVENT") if header else None).splitlines()
    ]
    return "\n".join(line.translate(_CONTROL) for line in lines)  # a command's escapes stay inert


def checkpoints_table(
    checkpoints: Sequence[pb.CheckpointInfo], wide: bool = False, header: bool = True
) -> str:
    """The job's checkpoints in `sing show`: each one's size, the pause it cost, when it was complete.

    Wide adds the device state taken from the pre-copy and the bytes copied in the pause.
    """
    rows = []
    for c in checkpoints:
        measured = c.pause_seconds > 0 or c.complete_seconds > 0
        pause = f"{c.pause_seconds:.2f}s" + (" (stop)" if c.stopped else "") if measured else "-"
        row = [
            str(c.seq),
            timestamp(c.created_at) if c.complete else "-",
            human_bytes(c.bytes) if c.complete else "-",
            pause if c.complete else "incomplete",
            f"{c.complete_seconds:.2f}s" if measured else "-",
        ]
        if wide:
            row += [
                human_bytes(c.precopied_bytes) if measured else "-",
                human_bytes(c.paused_bytes) if measured else "-",
            ]
        rows.append(row)
    columns = ("CHECKPOINT", "TAKEN", "SIZE", "PAUSE", "COMPLETE AFTER") + (
        ("PRE-COPIED", "IN PAUSE") if wide else ()
    )
    return table(rows, columns if header else None)


def _transition_text(event: pb.Event) -> str:
    """'PENDING -> RUNNING' for a change of state; just the state for an event within one."""
    if event.from_state == event.to_state:
        return event.to_state
    return f"{event.from_state or '-'} -> {event.to_state}"


def job_detail_dict(detail: pb.JobDetail) -> dict[str, Any]:
    """`sing show -o json`."""
    data = job_dict(detail.job)
    data["env"] = dict(detail.env) if detail.env else None
    data["log_path"] = detail.log_path or None
    data["checkpoint_list"] = [checkpoint_dict(c) for c in detail.checkpoint_list]
    data["events"] = [
        {"at": e.at, "from_state": e.from_state or None, "to_state": e.to_state, "reason": e.reason}
        for e in detail.events
    ]
    return data


def stopped_text(job: pb.Job, verb: str) -> str:
    """One line for `sing preempt` and `sing suspend`: the job stopped (or held) and the checkpoint
    it resumes from, e.g. 'job 4 preempted at checkpoint 2 (22.5M)'."""
    text = f"job {job.id} {verb}"
    if job.HasField("last_checkpoint"):
        text += f" at checkpoint {job.last_checkpoint.seq} ({human_bytes(job.last_checkpoint.bytes)})"
    return text


def checkpoint_text(response: pb.CheckpointResponse) -> str:
    """One line for `sing checkpoint`: which checkpoint, its size, the pause it cost."""
    taken = response.checkpoint
    text = (
        f"job {response.job.id}: checkpoint {taken.seq}, {human_bytes(taken.bytes)}, "
        f"paused {response.pause_seconds:.2f}s"
    )
    if taken.complete_seconds:
        text += f", complete after {taken.complete_seconds:.2f}s"
    if taken.precopied_bytes or taken.paused_bytes:
        text += (
            f" (device state: {human_bytes(taken.precopied_bytes)} pre-copied, "
            f"{human_bytes(taken.paused_bytes)} copied in the pause)"
        )
    return text


def sessions_text(device: pb.Device) -> str:
    """'3/0:1.2G,3/1:0B': each job/rank session on the device with the memory it holds."""
    return ",".join(f"{x.job}/{x.rank}:{human_bytes(x.bytes)}" for x in device.sessions) or "-"


def devices_table(devices: Sequence[pb.Device], wide: bool = False, header: bool = True) -> str:
    """The `sing devices` table (wide: with UUIDs, proxy health and each rank's session)."""
    rows = []
    for device in devices:
        util = f"{device.utilization_percent:.0f}%" if device.HasField("utilization_percent") else "-"
        memory = f"{human_bytes(device.memory_used)}/{human_bytes(device.memory_total)}"
        jobs = ",".join(str(j) for j in device.jobs) or "-"
        row = [str(device.index), device.kind, device.name, memory, util, jobs]
        if wide:
            row += [device.uuid or "-", device.proxy or "-", sessions_text(device)]
        rows.append(row)
    columns = ["INDEX", "KIND", "NAME", "MEMORY", "UTIL", "JOBS"]
    if wide:
        columns += ["UUID", "PROXY", "SESSIONS"]
    return table(rows, columns if header else None)
