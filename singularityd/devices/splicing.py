"""Replica splicing: which of a job's devices serves each device its processes see. Pure.

A job's processes always see the same devices, `logical_devices` of them (the larger of its rank
count and the devices it asked for at submission), whatever it holds now: a job of 4 ranks on 2
devices still sees cuda:0..3, and each rank's `set_device(LOCAL_RANK)` works. The job's proxy
servers (one per device it holds, its *slots*) serve those logical devices in contiguous blocks:
cuda:j is served by slot j * servers // logical. So with 4 logical devices and 2 servers, cuda:0
and cuda:1 share slot 0, cuda:2 and cuda:3 slot 1; ranks whose LOCAL_RANK is in one block share
one device. Every process of the job sees the same mapping, so a rank that touches another rank's
cuda:j reaches the server that rank uses. Collectives are reduced in global rank order by the
servers, so results do not depend on the mapping, and a resize only changes which slot holds
each rank's saved session (regroup.py).
"""

from __future__ import annotations

from dataclasses import dataclass


def logical_devices(ranks: int, gpus: int) -> int:
    """How many devices a job's processes see: constant for the job, whatever it holds."""
    return max(ranks, gpus)


def device_slots(logical: int, servers: int) -> list[int]:
    """For each logical device cuda:j, the slot (index of the job's held device) serving it."""
    if servers < 1 or servers > logical:
        raise ValueError(f"{servers} devices cannot serve {logical} logical devices")
    return [j * servers // logical for j in range(logical)]


def spliced(ranks: int, servers: int) -> bool:
    """Whether several ranks of a job share a device."""
    return servers < ranks


@dataclass(frozen=True)
class SavedLayout:
    """How a checkpoint's device state is spread: over `servers` slots, for `logical` devices."""

    logical: int
    servers: int
