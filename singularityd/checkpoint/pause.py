"""How long a checkpoint stopped the job, as the program felt it, and what its device state cost.

The pause is the time the job could not make progress: from the moment its first process parked
at its device proxy (or, without proxies, was frozen by CRIU) to the moment its last process ran
again; for a preemption, to the moment its processes were gone; for a restore, from the start of
the restore to the moment the processes ran again. The timestamps are taken where things happen
(each proxy server notes when a process parked and when it let it go; the daemon notes when CRIU
returned), all by CLOCK_MONOTONIC, which every process of the machine shares; wall-clock times are
derived from it for what is kept in manifests. No I/O here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from singularityd.units import human_bytes


def wall_clock(monotonic: float) -> float:
    """The wall-clock time (time.time()) of a CLOCK_MONOTONIC reading taken on this machine."""
    return time.time() - time.monotonic() + monotonic


@dataclass(frozen=True)
class DeviceSaveFigures:
    """What saving the device state cost, summed over the job's devices (bytes, seconds): the
    figures of each server's SaveReport (proxy/server/snapshot.py) that a manifest keeps."""

    live_bytes: int = 0
    precopy_rounds: int = 0
    precopy_written_bytes: int = 0
    precopy_dirtied_bytes: int = 0
    precopy_seconds: float = 0.0
    precopy_sync_seconds: float = 0.0
    precopy_ended: str = ""
    reused_bytes: int = 0
    paused_copied_bytes: int = 0
    pause_copy_seconds: float = 0.0
    written_after_bytes: int = 0
    write_after_seconds: float = 0.0
    written_in_pause: bool = False

    @staticmethod
    def summed(reports: Sequence[Mapping[str, Any]]) -> DeviceSaveFigures:
        """The figures of several devices' saves (as the servers report them) together: bytes add
        up, the devices work at once (the longest time counts), one unsettled pre-copy is enough."""

        def total(name: str) -> int:
            return sum(int(r.get(name) or 0) for r in reports)

        def longest(name: str) -> float:
            return max((float(r.get(name) or 0.0) for r in reports), default=0.0)

        endings = [str(r.get("precopy_ended") or "") for r in reports]
        return DeviceSaveFigures(
            live_bytes=total("live_bytes"),
            precopy_rounds=max((int(r.get("precopy_rounds") or 0) for r in reports), default=0),
            precopy_written_bytes=total("precopy_written_bytes"),
            precopy_dirtied_bytes=total("precopy_dirtied_bytes"),
            precopy_seconds=longest("precopy_seconds"),
            precopy_sync_seconds=longest("precopy_sync_seconds"),
            precopy_ended="unsettled" if "unsettled" in endings else next(iter(endings), ""),
            reused_bytes=total("reused_bytes"),
            paused_copied_bytes=total("paused_copied_bytes"),
            pause_copy_seconds=longest("pause_copy_seconds"),
            written_after_bytes=total("written_after_bytes"),
            write_after_seconds=longest("write_after_seconds"),
            written_in_pause=any(r.get("written_in_pause") for r in reports),
        )

    @property
    def unsettled(self) -> str:
        """Why the pre-copy could not get ahead of the job: it changed most of what was saved while
        it was being saved ("" when the pre-copy settled or did not run)."""
        if self.precopy_ended != "unsettled" or self.precopy_seconds <= 0 or not self.precopy_written_bytes:
            return ""
        share = self.precopy_dirtied_bytes / self.precopy_written_bytes
        saved = self.precopy_written_bytes / self.precopy_seconds
        return (
            f"the job changed {share:.0%} of its device state while the pre-copy saved it at "
            f"{human_bytes(saved)}/s, so the pause copies what changed"
        )


@dataclass(frozen=True)
class Pause:
    """The pause of one checkpoint: what the job lost, and when (wall clock)."""

    seconds: float
    stopped: bool
    """A preemption: the pause ends when the processes are gone (they resume only when restored)."""
    began_at: float
    ended_at: float
    frozen_s: float
    """CRIU's own freeze, inside the pause."""
    device: DeviceSaveFigures

    def as_dict(self) -> dict[str, Any]:
        """Plain values, for the manifest."""
        out = asdict(self)
        out["device"] = asdict(self.device)
        return out

    @staticmethod
    def from_dict(raw: Mapping[str, Any]) -> Pause | None:
        """The pause a manifest keeps (None when it has none or it is malformed)."""
        try:
            device = DeviceSaveFigures(**dict(raw.get("device") or {}))
            return Pause(
                float(raw["seconds"]),
                bool(raw["stopped"]),
                float(raw["began_at"]),
                float(raw["ended_at"]),
                float(raw["frozen_s"]),
                device,
            )
        except (KeyError, TypeError, ValueError):
            return None


def measure_pause(
    *,
    parked_at: Sequence[float],
    resumed_at: Sequence[float],
    criu_returned_at: float,
    frozen_s: float,
    stopped: bool,
    device: DeviceSaveFigures,
) -> Pause:
    """The pause from the proxies' and CRIU's timestamps (CLOCK_MONOTONIC).

    With proxies the job stops when its first process parks and goes on when the last one is let
    go (CRIU's freeze falls inside); a preempted job ends when CRIU returns (its processes gone).
    Without proxies the pause is CRIU's freeze, which ends as CRIU returns.
    """
    end = criu_returned_at if stopped or not resumed_at else max(resumed_at)
    start = min(parked_at) if parked_at else end - frozen_s
    start = min(start, end - frozen_s)
    return Pause(end - start, stopped, wall_clock(start), wall_clock(end), frozen_s, device)


@dataclass(frozen=True)
class Downtime:
    """How long a restored job was down: restoring it, and (after a preemption) in all."""

    restore_s: float
    """From the start of the restore to the processes running again."""
    total_s: float | None
    """From the pause of the checkpoint (a preemption) to running again; None when not known."""
    stopped_s: float | None
    """The preemption's own pause (first park to processes gone)."""

    def summary(self) -> str:
        """What the restore event says about it."""
        if self.total_s is None or self.stopped_s is None:
            return f"down {self.restore_s:.2f}s while restoring"
        waited = max(0.0, self.total_s - self.stopped_s - self.restore_s)
        return (
            f"down {self.total_s:.2f}s in all: {self.stopped_s:.2f}s stopping, {waited:.2f}s "
            f"until restored, {self.restore_s:.2f}s restoring"
        )


def downtime(restore_began: float, running_at: float, checkpoint: Pause | None) -> Downtime:
    """A restore's downtime from its start and end (CLOCK_MONOTONIC) and the checkpoint's pause."""
    restore_s = max(0.0, running_at - restore_began)
    if checkpoint is None or not checkpoint.stopped:
        return Downtime(restore_s, None, None)
    total = max(restore_s, wall_clock(running_at) - checkpoint.began_at)
    return Downtime(restore_s, total, checkpoint.seconds)


def pause_summary(pause: Pause, complete_s: float) -> str:
    """What a checkpoint event says about its pause, the pre-copy and when it was complete."""
    device = pause.device
    if pause.stopped:
        text = f"stopped in {pause.seconds:.2f}s"
    else:
        text = f"paused {pause.seconds:.2f}s, complete after {complete_s:.2f}s"
    if device.live_bytes:
        text += (
            f"; device state {human_bytes(device.live_bytes)}: {human_bytes(device.reused_bytes)} "
            f"pre-copied, {human_bytes(device.paused_copied_bytes)} copied in the pause"
        )
        if pause.stopped:
            text += f", {human_bytes(device.written_after_bytes)} written while stopped"
        elif device.written_in_pause:
            text += ", written in the pause (no host memory to copy it into)"
    if device.unsettled:
        text += f"; {device.unsettled}"
    return text


@dataclass(frozen=True)
class RestoreParts:
    """Where a restore's time went, in seconds: checking the files against the manifest, the
    proxies loading the device state, CRIU, and the proxies letting the processes go on."""

    verify_s: float
    hashed_bytes: int
    device_state_s: float
    criu_s: float
    resume_s: float
    device_file_bytes: int = 0
    """Bytes of the device-state files loaded."""
    preloaded_bytes: int = 0
    """Of the device state, bytes the proxies took as they had preloaded them (not read)."""

    def summary(self) -> str:
        """The parts as an event says them."""
        loaded = f"device state loaded in {self.device_state_s:.2f}s"
        if self.preloaded_bytes:
            read = human_bytes(max(0, self.device_file_bytes - self.preloaded_bytes))
            loaded += f" ({read} read, {human_bytes(self.preloaded_bytes)} taken preloaded)"
        return (
            f"checked the files in {self.verify_s:.2f}s ({human_bytes(self.hashed_bytes)} read and hashed), "
            f"{loaded}, CRIU {self.criu_s:.2f}s, proxies resumed in {self.resume_s:.2f}s"
        )
