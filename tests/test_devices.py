"""Device inventory: virtual devices, and the NVML path exercised with a fake NVML library."""

from __future__ import annotations

import types

import pytest

from singularityd.devices import inventory as devices


class FakeNVMLError(Exception):
    pass


def fake_nvml(count: int) -> types.ModuleType:
    """A stand-in for pynvml on a machine without GPUs (NVML is outside the system under test)."""
    module = types.ModuleType("pynvml")
    state = {"init": False}

    def init() -> None:
        state["init"] = True

    def handle(index: int) -> int:
        assert state["init"], "nvmlInit must come first"
        return index

    def utilization(h: int) -> types.SimpleNamespace:
        if h == 1:
            raise FakeNVMLError("not supported")
        return types.SimpleNamespace(gpu=37)

    module.__dict__.update(
        NVMLError=FakeNVMLError,
        nvmlInit=init,
        nvmlDeviceGetCount=lambda: count,
        nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetName=lambda h: b"NVIDIA H200",
        nvmlDeviceGetUUID=lambda h: f"GPU-{h:04d}",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=141 * 2**30, used=2**30 * h),
        nvmlDeviceGetUtilizationRates=utilization,
    )
    return module


def test_virtual_devices_when_asked() -> None:
    inventory = devices.discover("virtual", 3, 2.0)
    assert [d.index for d in inventory.devices] == [0, 1, 2]
    assert inventory.kind == "virtual"
    assert inventory.devices[0].memory_total == 2 * 2**30


def test_nvml_devices_are_used_when_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "_load_nvml", lambda: fake_nvml(2))
    inventory = devices.discover("auto", 4, 16)
    assert inventory.kind == "nvml"
    assert [(d.name, d.uuid, d.utilization_percent) for d in inventory.devices] == [
        ("NVIDIA H200", "GPU-0000", 37.0),
        ("NVIDIA H200", "GPU-0001", None),
    ]
    assert inventory.devices[1].memory_used == 2**30
    assert devices.refresh(inventory).devices == inventory.devices


def test_auto_falls_back_to_virtual_and_nvml_mode_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> types.ModuleType:
        raise ImportError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(devices, "_load_nvml", broken)
    inventory = devices.discover("auto", 2, 1)
    assert inventory.kind == "virtual" and len(inventory.devices) == 2
    assert inventory.nvml_status.startswith("unavailable: libnvidia-ml.so.1")
    with pytest.raises(RuntimeError, match="devices = 'nvml' but NVML is unavailable"):
        devices.discover("nvml", 2, 1)
    monkeypatch.setattr(devices, "_load_nvml", lambda: fake_nvml(0))
    assert devices.discover("auto", 2, 1).nvml_status == "available, but no GPU found"
