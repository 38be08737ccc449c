"""Splicing only data-parallel replicas: what the daemon does with its proxy servers' verdict. Pure.

While a job runs with more ranks than devices (devices/splicing.py), its servers judge whether
the ranks sharing each device are data-parallel replicas (proxy/server/dedup.py); the daemon asks
them now and then (`wants_verdict`). When a server says they are not, the job is marked with that
reason (its *splice refusal*, stored with it) and stops sharing devices: resized to one device per
rank when that many are free counting its own (`unsplice`), else checkpointed and queued until
they are. A marked job is never spliced again: its range of devices starts at its rank count
(`device_range`), a resize below it is refused with the reason (`resize_refusal`), and while it
waits its pending reason says why it needs that many (`pending_reason`).
"""

from __future__ import annotations

from dataclasses import dataclass

from singularityd.units import counted


@dataclass(frozen=True)
class Unsplice:
    """Stop splicing a job: move it to `devices` devices (one per rank), at once when `now`
    (enough are free), else checkpoint it and let it wait for them in the queue."""

    devices: int
    now: bool

    def describe(self, refusal: str) -> str:
        """The event that says what is done and why."""
        if self.now:
            plan = f"resizing it to {counted(self.devices, 'device')}, one per rank"
        else:
            plan = f"checkpointing it until {counted(self.devices, 'device')}, one per rank, are free"
        return f"splicing refused: {refusal}; {plan}"


def wants_verdict(ranks: int, devices: int, refusal: str, idle: bool) -> bool:
    """Whether to ask a running job's servers their verdict now: its ranks share devices, it is not
    already refused, and nothing (launch, checkpoint) is under way with it."""
    return idle and not refusal and 0 < devices < ranks


def unsplice(ranks: int, held: int, free: int) -> Unsplice:
    """How a refused job holding `held` devices stops splicing, with `free` others free now."""
    return Unsplice(ranks, held + free >= ranks)


def device_range(ranks: int, min_devices: int, max_devices: int, refusal: str) -> tuple[int, int]:
    """A job's range of devices as the scheduler may use it (both 0: not elastic): a refused job's
    never goes below its rank count."""
    if not refusal or not max_devices:
        return min_devices, max_devices
    return max(min_devices, ranks), max(max_devices, ranks)


def resize_refusal(job_id: int, ranks: int, gpus: int, refusal: str) -> str:
    """Why a resize to `gpus` devices is refused ('' when it is not): a refused job's ranks may
    not share devices."""
    if refusal and gpus < ranks:
        return f"job {job_id}'s {ranks} ranks need one device each ({refusal})"
    return ""


def pending_reason(reason: str, refusal: str) -> str:
    """A waiting job's pending reason, with why a refused job needs one device per rank."""
    if not refusal or not reason or not reason.startswith(("Resources", "Unsatisfiable")):
        return reason
    return f"{reason} (one per rank: {refusal})"
