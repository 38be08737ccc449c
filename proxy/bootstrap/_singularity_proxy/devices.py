"""The proxied devices of this process: their connections, opened on first use, and the current one."""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

import torch

from . import protocol
from .channel import Channel

FORKED_CHILD = (
    "Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, you must use "
    "the 'spawn' start method"
)
"""torch's error where the forked child of a process that used CUDA uses it: here too, for the
child has its parent's connections but not their reader threads."""

INVALID_ORDINAL = (
    "CUDA error: invalid device ordinal\nCUDA kernel errors might be asynchronously reported at "
    "some other API call, so the stacktrace below might be incorrect."
)


class DeviceTable:
    """Devices given to this process (one socket path each) and the one currently selected."""

    def __init__(self) -> None:
        self.channels: list[Channel | None] = []
        self.paths: list[str] = []
        self.job_id = ""
        self.rank = 0
        self.current = 0
        self.initialized = False
        self.in_bad_fork = False
        """A forked child of a process that used the devices (which the child may not use)."""
        self.lock = threading.Lock()

    def configure(self, paths: list[str], job_id: str, rank: int) -> None:
        """Take the devices the daemon gave this process."""
        self.paths = list(paths)
        self.channels = [None] * len(paths)
        self.job_id = job_id
        self.rank = rank
        self.current = 0

    def channel(self, index: int | None = None) -> Channel:
        """The connection to device `index` (default: the current one), opened on first use."""
        if self.in_bad_fork:
            raise RuntimeError(FORKED_CHILD)
        chosen = self.current if index is None else index
        if chosen < 0 or chosen >= len(self.paths):
            raise RuntimeError(INVALID_ORDINAL)
        channel = self.channels[chosen]
        if channel is None:
            with self.lock:
                channel = self.channels[chosen]
                if channel is None:
                    channel = Channel(self.paths[chosen], chosen, self.job_id, self.rank, os.getpid())
                    self.channels[chosen] = channel
        self.initialized = True
        return channel

    def forked(self) -> None:
        """In a forked child: devices its parent used are unusable here, as CUDA is."""
        if self.initialized:
            self.in_bad_fork = True
            self.initialized = False

    def close(self) -> None:
        """At exit, send what each open connection still queues (a GPU finishes the work a process
        launched before it ended, and the other ranks' collectives may wait for this one's last),
        then close it (Channel.close: no reader thread may outlive the program)."""
        for channel in self.channels:
            if channel is not None:
                channel.close()


DEVICES = DeviceTable()
atexit.register(DEVICES.close)
os.register_at_fork(after_in_child=DEVICES.forked)


def device_index(device: Any) -> int:
    """Index of a cuda device given as int, str or torch.device (None: the current device)."""
    if device is None:
        return DEVICES.current
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        return DEVICES.current if device.index is None else device.index
    return int(device)


def same_device_error(first: str, second: str) -> RuntimeError:
    """What CUDA raises when one operation mixes tensors of two devices."""
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"{first} and {second}!"
    )


def synchronize(index: int | None = None) -> None:
    """Wait until every operation queued for a device (or for all devices) has run."""
    if index is not None and not 0 <= index < len(DEVICES.paths):
        raise RuntimeError(INVALID_ORDINAL)
    channels = DEVICES.channels if index is None else [DEVICES.channels[index]]
    for channel in channels:
        if channel is not None:
            channel.request([protocol.REQ_SYNC])


def device_figure(what: str, device: Any = None) -> Any:
    """A figure of this process's memory on a device, or of the device (one of
    protocol.FIGURE_QUERIES), once what was queued for the device before it has run."""
    return DEVICES.channel(device_index(device)).request([protocol.REQ_FIGURE, what])
