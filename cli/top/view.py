"""What `sing top` shows, computed from API messages with no widgets: cells, colours, bars, texts.

Every function takes the current time as an argument, so the picture depends only on the data
and the clock it is given (the snapshot tests freeze both).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rich.text import Text

from singularity.cli.output import ago, devices_or_reason, duration, exit_text, gpus_cell, run_time
from singularityd.api.v1 import singularity_pb2 as pb
from singularityd.tiers import TIERS, tier_rank
from singularityd.units import human_bytes

STATE_STYLES = {
    "RUNNING": "bold green",
    "PENDING": "yellow",
    "PREEMPTED": "magenta",
    "SUSPENDED": "blue",
    "MIGRATING": "cyan",
    "COMPLETED": "dim green",
    "FAILED": "bold red",
    "CANCELLED": "dim",
}
BAR_WIDTH = 10
REASON_WIDTH = 34
COMMAND_WIDTH = 200


def styled(*parts: tuple[str, str]) -> Text:
    """Text made of (text, style) parts."""
    text = Text()
    for part, style in parts:
        text.append(part, style=style)
    return text


def state_text(job: pb.Job) -> Text:
    """The job's state in its colour; a running job still being started or restored says so."""
    label = job.state
    if job.starting:
        label = "RESTORING" if job.checkpoints else "STARTING"
    return Text(label, style=STATE_STYLES.get(job.state, ""))


def tier_text(tier: str) -> Text:
    """The tier in colour, like a priority: premium stands out, basic recedes."""
    return Text(tier, style="bold yellow" if tier == TIERS[-1] else "dim" if tier == TIERS[0] else "")


def priority_text(priority: int) -> Text:
    """Priority in colour: above normal stands out, below normal recedes."""
    return Text(str(priority), style="bold yellow" if priority > 0 else "dim" if priority < 0 else "")


def bar(fraction: float | None, label: str, width: int = BAR_WIDTH) -> Text:
    """A meter like '███░░░░░░░ 30%': green, yellow over 60%, red over 85%; only the label if unknown."""
    if fraction is None:
        return Text(" " * width + " " + label, style="dim")
    fraction = min(1.0, max(0.0, fraction))
    filled = round(fraction * width)
    colour = "red" if fraction > 0.85 else "yellow" if fraction > 0.6 else "green"
    return styled(("█" * filled, colour), ("░" * (width - filled), "dim"), (" " + label, ""))


def reason_of(job: pb.Job) -> str:
    """Why the job is where it is: the pending reason of a queued job, else its last reason."""
    if job.starting:
        return "restoring from its checkpoint" if job.checkpoints else "starting"
    if job.state in ("PENDING", "PREEMPTED") and job.pending_reason:
        return job.pending_reason
    return job.reason


@dataclass(frozen=True)
class Column:
    """One column of the jobs table: its cell and the value it sorts by."""

    key: str
    label: str
    width: int | None
    cell: Callable[[pb.Job, float], str | Text]
    sort_value: Callable[[pb.Job, float], Any]


def _devices_cell(job: pb.Job) -> str:
    """The job's devices, comma-separated, or '-'."""
    return ",".join(str(d) for d in job.devices) or "-"


def _short(text: str, limit: int = REASON_WIDTH) -> str:
    """The text, cut to `limit` characters with an ellipsis (the detail pane shows it whole)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _checkpoint_age(job: pb.Job, now: float) -> float:
    """Seconds since the job's last checkpoint (infinite without one, so those sort last)."""
    return now - job.last_checkpoint.created_at if job.HasField("last_checkpoint") else float("inf")


def _checkpoint_cell(job: pb.Job, now: float, field: str) -> str:
    """The age, size or pause of the job's last checkpoint, or '-'."""
    if not job.HasField("last_checkpoint"):
        return "-"
    last = job.last_checkpoint
    if field == "age":
        return duration(now - last.created_at)
    return human_bytes(last.bytes) if field == "size" else f"{last.pause_seconds:.2f}s"


def _checkpoint_number(job: pb.Job, field: str) -> float:
    """A numeric field of the job's last checkpoint, -1 without one."""
    return float(getattr(job.last_checkpoint, field)) if job.HasField("last_checkpoint") else -1.0


JOB_COLUMNS: tuple[Column, ...] = (
    Column("id", "ID", 4, lambda j, n: str(j.id), lambda j, n: j.id),
    Column("name", "NAME", 12, lambda j, n: j.name, lambda j, n: j.name),
    Column("user", "USER", 8, lambda j, n: j.user, lambda j, n: j.user),
    Column("state", "STATE", 9, lambda j, n: state_text(j), lambda j, n: j.state),
    Column("tier", "TIER", 8, lambda j, n: tier_text(j.tier), lambda j, n: tier_rank(j.tier)),
    Column("priority", "PRI", 4, lambda j, n: priority_text(j.priority), lambda j, n: j.priority),
    Column("gpus", "GPUS", 4, lambda j, n: gpus_cell(j), lambda j, n: j.gpus),
    Column("devices", "DEVICES", 7, lambda j, n: _devices_cell(j), lambda j, n: list(j.devices)),
    Column("age", "AGE", 8, lambda j, n: duration(n - j.submitted_at), lambda j, n: n - j.submitted_at),
    Column("time", "TIME", 8, lambda j, n: duration(run_time(j, n)), lambda j, n: run_time(j, n)),
    Column("ckpt_age", "CKPT AGE", 8, lambda j, n: _checkpoint_cell(j, n, "age"), _checkpoint_age),
    Column("ckpt_size", "SIZE", 7, lambda j, n: _checkpoint_cell(j, n, "size"),
           lambda j, n: _checkpoint_number(j, "bytes")),
    Column("ckpt_pause", "PAUSE", 6, lambda j, n: _checkpoint_cell(j, n, "pause"),
           lambda j, n: _checkpoint_number(j, "pause_seconds")),
    Column("reason", "REASON", None, lambda j, n: _short(reason_of(j)), lambda j, n: reason_of(j)),
)  # fmt: skip
COLUMN_KEYS = tuple(c.key for c in JOB_COLUMNS)


def job_cells(job: pb.Job, now: float) -> tuple[str | Text, ...]:
    """One row of the jobs table."""
    return tuple(column.cell(job, now) for column in JOB_COLUMNS)


def matches(job: pb.Job, words: str) -> bool:
    """Whether every word of a `/` filter occurs (case-insensitively) in the job's visible text."""
    if not words.strip():
        return True
    haystack = " ".join(
        [str(job.id), job.name, job.user, job.state, reason_of(job), " ".join(job.command)]
        + [f"dev{d}" for d in job.devices]
    ).lower()
    return all(word in haystack for word in words.lower().split())


def sessions_by_job(devices: Iterable[pb.Device]) -> dict[int, list[tuple[int, int, int]]]:
    """For each job: (rank, device, bytes) of every session its ranks hold on a device."""
    found: dict[int, list[tuple[int, int, int]]] = {}
    for device in devices:
        for session in device.sessions:
            found.setdefault(session.job, []).append((session.rank, device.index, session.bytes))
    return {job: sorted(entries) for job, entries in found.items()}


def device_jobs_text(device: pb.Device, jobs: dict[int, pb.Job]) -> Text:
    """The job-to-device map for one device: each job on it with its ranks there, as '3:train r0 r1'."""
    ranks: dict[int, list[int]] = {}
    for session in device.sessions:
        ranks.setdefault(session.job, []).append(session.rank)
    text = Text()
    for job_id in sorted(set(device.jobs) | set(ranks)):
        if text:
            text.append("  ")
        job = jobs.get(job_id)
        text.append(str(job_id), style="bold")
        if job is not None:
            text.append(f":{job.name}")
        if job_id in ranks:
            text.append(" " + " ".join(f"r{r}" for r in sorted(ranks[job_id])), style="cyan")
    return text or Text("idle", style="dim")


def proxy_text(device: pb.Device) -> Text:
    """Proxy health: up in green, starting in yellow, idle dimmed, down in red, '-' without proxies."""
    if not device.proxy:
        return Text("-", style="dim")
    if device.proxy == "up":
        return Text("up", style="green")
    if device.proxy == "idle":
        return Text("idle", style="dim")
    if device.proxy == "starting":
        return Text("starting", style="yellow")
    return Text(device.proxy, style="bold red")


DEVICE_COLUMNS = (("dev", "DEV", 3), ("name", "NAME", None), ("util", "UTIL", 15), ("memory", "MEMORY", 23),
                  ("proxy", "PROXY", 8), ("jobs", "JOBS AND RANKS", None))  # fmt: skip


def device_cells(device: pb.Device, jobs: dict[int, pb.Job]) -> tuple[str | Text, ...]:
    """One row of the devices table."""
    util = device.utilization_percent / 100 if device.HasField("utilization_percent") else None
    util_label = f"{device.utilization_percent:.0f}%" if util is not None else "n/a"
    memory = device.memory_used / device.memory_total if device.memory_total else None
    memory_label = f"{human_bytes(device.memory_used)}/{human_bytes(device.memory_total)}"
    return (
        str(device.index),
        device.name,
        bar(util, util_label),
        bar(memory, memory_label),
        proxy_text(device),
        device_jobs_text(device, jobs),
    )


PEER_COLUMNS = (("node", "NODE", None), ("address", "ADDRESS", None), ("state", "STATE", 16),
                ("free", "FREE DEVICES", 20), ("version", "VERSION", None), ("contact", "LAST CONTACT", 14),
                ("error", "ERROR", None))  # fmt: skip
PEER_STATE_STYLES = {"alive": "green", "suspect": "yellow", "dead": "bold red"}


def peer_cells(peer: pb.Peer, now: float) -> tuple[str | Text, ...]:
    """One row of the peers table: its state in colour, its free devices as a bar, its last contact."""
    state = Text(peer.state, style=PEER_STATE_STYLES.get(peer.state, ""))
    if peer.draining:
        state.append(", draining", style="magenta")
    used = (peer.devices - peer.free) / peer.devices if peer.devices else None
    return (
        peer.node,
        peer.address,
        state,
        bar(used, f"{peer.free}/{peer.devices} free"),
        peer.version or "-",
        ago(peer.last_contact, now),
        _short(peer.error, 60),
    )


def peers_title(peers: pb.ListPeersResponse) -> str:
    """The peers pane's title: this node's name and number, and whether it is draining."""
    return f"Peers of {peers.node} (node {peers.node_number}{', draining' if peers.draining else ''})"


def migration_targets(peers: pb.ListPeersResponse, devices_needed: int) -> list[pb.Peer]:
    """Peers a job can be moved to now: alive, not draining, with the devices it needs free."""
    return [p for p in peers.peers if p.state == "alive" and not p.draining and p.free >= devices_needed]


def resize_refusal(job: pb.Job) -> str:
    """Why the job cannot be resized now ('' when it can): only a running job of several ranks
    that may share devices (one whose ranks are not replicas already has one device per rank)."""
    if job.ranks < 2:
        return f"job {job.id} has one rank: only a job of several ranks can be resized"
    if job.state != "RUNNING":
        return f"job {job.id} is {job.state}; only a RUNNING job can be resized"
    if job.splice_refusal:
        return f"job {job.id}'s ranks need one device each ({job.splice_refusal})"
    return ""


def title_text(info: pb.DaemonInfo, where: str, jobs: Sequence[pb.Job], now: float) -> Text:
    """The top line: the daemon, where it is, its uptime and the jobs by state."""
    text = Text(f"singularityd {info.version}", style="bold")
    text.append(f"  {info.mode} mode · {where} · up {duration(now - info.started_at)}")
    text.append(f" · {info.device_count} {info.device_kind} device(s)")
    counts: dict[str, int] = {}
    for job in jobs:
        counts[job.state] = counts.get(job.state, 0) + 1
    for state in STATE_STYLES:
        if counts.get(state):
            text.append(" · ")
            text.append(f"{counts[state]} {state.lower()}", style=STATE_STYLES[state])
    return text


def clock(at: float) -> str:
    """A local time of day, or '-' for unset."""
    return time.strftime("%H:%M:%S", time.localtime(at)) if at else "-"


def ranks_text(job: pb.Job, devices: Sequence[pb.Device]) -> str:
    """Which device each rank uses (from the proxies' sessions), else the devices all ranks share."""
    sessions = sessions_by_job(devices).get(job.id)
    if sessions:
        return "  ".join(f"r{rank}→dev{device} {human_bytes(held)}" for rank, device, held in sessions)
    if not job.devices:
        return f"{job.ranks} rank(s), no devices now"
    listed = ",".join(str(d) for d in job.devices)
    return f"{job.ranks} rank(s), sharing device(s) {listed}"


def overview_text(detail: pb.JobDetail, devices: Sequence[pb.Device], now: float) -> Text:
    """The job detail's first tab: spec, status, ranks on devices, checkpoints."""
    job = detail.job
    text = Text()
    text.append(f"Job {job.id} ", style="bold")
    text.append(f"{job.name}  ({job.user}, uid {job.uid})  ")
    text.append_text(state_text(job))
    text.append(", tier ")
    text.append_text(tier_text(job.tier))
    text.append(", priority ")
    text.append_text(priority_text(job.priority))
    lines = [
        ("Reason", reason_of(job)),
        ("Command", _short(" ".join(job.command).replace("\n", "⏎"), COMMAND_WIDTH)),
        ("Directory", job.cwd),
        (
            "Times",
            f"submitted {clock(job.submitted_at)} ({duration(now - job.submitted_at)} ago), "
            f"started {clock(job.started_at)}, ran {duration(run_time(job, now))}, attempt {job.attempt}",
        ),
        ("Usage", f"CPU {job.cpu_seconds:.1f}s, memory {human_bytes(job.rss_bytes)}, exit {exit_text(job)}"),
        ("Devices", devices_or_reason(job) or "-"),
        ("Ranks", ranks_text(job, devices)),
    ]
    interval = f"every {job.checkpoint_interval:g}s" if job.checkpoint_interval else "on demand"
    checkpoints = f"{job.checkpoints} kept, {human_bytes(job.checkpoint_bytes)} ({interval})"
    if job.HasField("last_checkpoint"):
        last = job.last_checkpoint
        checkpoints += (
            f"; last #{last.seq} {duration(now - last.created_at)} ago, "
            f"{human_bytes(last.bytes)}, paused {last.pause_seconds:.2f}s"
        )
    lines.append(("Checkpoints", checkpoints))
    if detail.log_path:
        lines.append(("Log", detail.log_path))
    for label, value in lines:
        text.append("\n")
        text.append(f"{label:<12}", style="bold")
        text.append(value)
    return text


def checkpoint_rows(detail: pb.JobDetail, now: float) -> list[tuple[str, ...]]:
    """The job detail's checkpoints: number, time, age, size, pause, completeness."""
    return [
        (str(c.seq), clock(c.created_at), duration(now - c.created_at) if c.created_at else "-",
         human_bytes(c.bytes), f"{c.pause_seconds:.2f}s", "complete" if c.complete else "incomplete")
        for c in detail.checkpoint_list
    ]  # fmt: skip


def event_rows(detail: pb.JobDetail) -> list[tuple[str | Text, ...]]:
    """The job detail's event timeline: time, state change, reason."""
    rows: list[tuple[str | Text, ...]] = []
    for event in detail.events:
        change = Text(event.to_state, style=STATE_STYLES.get(event.to_state, ""))
        if event.from_state and event.from_state != event.to_state:
            before = (event.from_state, STATE_STYLES.get(event.from_state, ""))
            change = styled(before, (" → ", ""), (event.to_state, STATE_STYLES.get(event.to_state, "")))
        rows.append((clock(event.at), change, event.reason))
    return rows
