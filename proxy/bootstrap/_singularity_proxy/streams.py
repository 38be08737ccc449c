# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""Streams and events of proxied devices, as far as a program can observe them.

A proxied device runs a process's work in order, so every stream of a device is one stream and
waiting between streams is nothing; synchronising, querying and recording an event wait for the
device, so timings are real. `torch.Stream`/`torch.Event` of a cuda device and
`Tensor.record_stream` are patched to these (cuda_surface.py installs them).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .devices import DEVICES, device_index, synchronize


class Stream:
    """A cuda stream as far as a program can observe it: work on it runs in order."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("cuda", device_index(device))
        self.device_index = self.device.index
        self.device_type = 1
        self.priority = priority
        self.cuda_stream = 0
        self.stream_id = 0

    def synchronize(self) -> None:
        synchronize(self.device.index)

    def query(self) -> bool:
        synchronize(self.device.index)
        return True

    def is_capturing(self) -> bool:
        return False

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Event:
        recorded = event if event is not None else Event()
        recorded.record(self)
        return recorded

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class Event:
    """A cuda event: recording it waits for the device, so timings are real."""

    def __init__(
        self,
        enable_timing: bool = False,
        blocking: bool = False,
        interprocess: bool = False,
        *,
        device: Any = None,
    ) -> None:
        self._recorded_at: float | None = None
        self._device: int | None = None
        self._timing = enable_timing
        self._home = None if device is None else DEVICES.channel(device_index(device)).index
        """The device `torch.Event(device)` names (it must exist), recorded on when no stream is given."""

    def record(self, stream: Any = None) -> None:
        if stream is not None:
            self._device = stream.device.index
        else:
            self._device = DEVICES.current if self._home is None else self._home
        synchronize(self._device)
        self._recorded_at = time.perf_counter()

    def synchronize(self) -> None:
        if self._device is not None:
            synchronize(self._device)

    def query(self) -> bool:
        self.synchronize()
        return True

    def wait(self, stream: Any = None) -> None:
        pass

    def elapsed_time(self, end_event: Event) -> float:
        if not (self._timing and end_event._timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._recorded_at is None or end_event._recorded_at is None:
            raise RuntimeError(
                "CUDA error: device not ready\nBoth events must be recorded before calculating elapsed time."
            )
        return (end_event._recorded_at - self._recorded_at) * 1000.0


_STREAMS: dict[int, Stream] = {}


def device_stream(device: Any = None) -> Stream:
    """The one stream of a device (current and default alike)."""
    index = device_index(device)
    stream = _STREAMS.get(index)
    if stream is None:
        stream = _STREAMS[index] = Stream(index)
    return stream


class StreamContext:
    """`with torch.cuda.stream(s)`: work runs in order whatever the stream."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __enter__(self) -> Any:
        return self.stream

    def __exit__(self, *exc: object) -> None:
        pass


def patch_stream_class() -> None:
    """`torch.Stream(0)`, `torch.Stream("cuda")`: a proxied device's stream (torch's own asks the
    C++ accelerator, of which a CPU build has none); a host stream stays torch's."""
    host_stream = torch.Stream

    class AcceleratorStream(host_stream):  # type: ignore[misc,valid-type]
        def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Any:
            if device is None or isinstance(device, int) or torch.device(device).type == "cuda":
                return Stream(device, priority)
            return host_stream.__new__(cls, device, priority, **kwargs)

    AcceleratorStream.__name__ = AcceleratorStream.__qualname__ = "Stream"
    AcceleratorStream.__module__ = "torch"
    torch.Stream = AcceleratorStream  # type: ignore[misc,assignment]


def patch_event_class() -> None:
    """`torch.Event("cuda")`, `torch.Event(enable_timing=True)`: a proxied device's event (torch's
    own asks the C++ accelerator, of which a CPU build has none); a host event stays torch's."""
    host_event = torch.Event

    class AcceleratorEvent(host_event):  # type: ignore[misc,valid-type]
        def __new__(cls, device: Any = None, **options: Any) -> Any:
            if device is None or isinstance(device, int) or torch.device(device).type == "cuda":
                return Event(**options, device=device)
            return host_event.__new__(cls, device, **options)

    AcceleratorEvent.__name__ = AcceleratorEvent.__qualname__ = "Event"
    AcceleratorEvent.__module__ = "torch"
    torch.Event = AcceleratorEvent  # type: ignore[misc,assignment]


def patch_record_stream() -> None:
    """`Tensor.record_stream(stream)`: nothing to do for a cuda tensor, whose work runs in order (the
    C++ method would refuse the stream before any dispatch: it is not torch's)."""
    record_stream = torch.Tensor.record_stream

    def recorded(self: torch.Tensor, stream: Any) -> None:
        if self.is_cuda:
            return None
        return record_stream(self, stream)  # type: ignore[no-any-return]

    torch.Tensor.record_stream = recorded  # type: ignore[method-assign,assignment]
