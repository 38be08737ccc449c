"""Device inventory: NVIDIA GPUs through NVML when present, otherwise CPU-backed virtual devices."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

GIB = 1024**3


@dataclass(frozen=True)
class Device:
    """One accelerator the daemon owns: a real GPU or a virtual device backed by the CPU."""

    index: int
    kind: str
    name: str
    uuid: str
    memory_total: int
    memory_used: int = 0
    utilization_percent: float | None = None


@dataclass(frozen=True)
class Inventory:
    """The devices found at start, and why NVML was or was not used."""

    devices: tuple[Device, ...]
    nvml_status: str

    @property
    def kind(self) -> str:
        """'nvml' or 'virtual' (all devices are of one kind)."""
        return self.devices[0].kind if self.devices else "virtual"


def _load_nvml() -> ModuleType:
    return importlib.import_module("pynvml")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_devices(nvml: ModuleType) -> tuple[Device, ...]:
    """Read every GPU NVML reports, with name, memory and utilisation."""
    devices = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            utilization: float | None = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except nvml.NVMLError:
            utilization = None
        devices.append(
            Device(
                index=index,
                kind="nvml",
                name=_text(nvml.nvmlDeviceGetName(handle)),
                uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                memory_total=int(memory.total),
                memory_used=int(memory.used),
                utilization_percent=utilization,
            )
        )
    return tuple(devices)


def virtual_devices(count: int, memory_gib: float) -> tuple[Device, ...]:
    """`count` CPU-backed devices, each with the configured memory capacity."""
    return tuple(
        Device(
            index=i,
            kind="virtual",
            name="Singularity Virtual Device (CPU)",
            uuid=f"VDEV-{i:04d}",
            memory_total=int(memory_gib * GIB),
        )
        for i in range(count)
    )


def discover(mode: str, count: int, memory_gib: float) -> Inventory:
    """Find the devices to offer: NVML GPUs ('nvml', or 'auto' when any), else virtual ones."""
    if mode == "virtual":
        return Inventory(virtual_devices(count, memory_gib), "not used (devices = 'virtual')")
    try:
        nvml = _load_nvml()
        nvml.nvmlInit()
        found = nvml_devices(nvml)
    except Exception as error:
        status = f"unavailable: {_text(error) or type(error).__name__}"
        if mode == "nvml":
            raise RuntimeError(f"devices = 'nvml' but NVML is {status}") from None
        log.info("NVML %s; offering %d virtual devices", status, count)
        return Inventory(virtual_devices(count, memory_gib), status)
    if not found:
        if mode == "nvml":
            raise RuntimeError("devices = 'nvml' but NVML reports no GPU")
        return Inventory(virtual_devices(count, memory_gib), "available, but no GPU found")
    return Inventory(found, f"available, {len(found)} GPU(s)")


def refresh(inventory: Inventory) -> Inventory:
    """Re-read live memory use and utilisation of NVML devices; virtual ones stay as they are."""
    if inventory.kind != "nvml":
        return inventory
    try:
        return Inventory(nvml_devices(_load_nvml()), inventory.nvml_status)
    except Exception as error:
        log.warning("NVML refresh failed: %s", error)
        return inventory
