# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""What `torch.cuda` and `torch.accelerator` answer in a job on proxied devices.

Device count, properties, memory figures and synchronisation are answered from the proxy
servers (streams and events: streams.py). Random numbers are drawn on the host with the job's CPU generator
(randomness.py), so the RNG state `torch.cuda` reads and sets is that generator's, and seeding is
a no-op; `autocast("cuda")` also casts stand-ins, whose C++ device is the host.
"""

from __future__ import annotations

import os
import sys
import types
import warnings
from typing import Any

import torch

from . import legacy_types, protocol
from .devices import DEVICES, FORKED_CHILD, device_figure, device_index, synchronize
from .randomness import DeviceDefaultGenerator, set_device_rng_state
from .streams import (
    Event,
    Stream,
    StreamContext,
    device_stream,
    patch_event_class,
    patch_record_stream,
    patch_stream_class,
)


class _DeviceProperties:
    """What torch.cuda.get_device_properties reports for a proxied device."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.name: str = info["name"]
        self.total_memory: int = int(info["total_memory"])
        self.major: int = int(info.get("major", 8))
        self.minor: int = int(info.get("minor", 0))
        self.multi_processor_count: int = int(info.get("multi_processor_count", 1))
        self.is_integrated = 0
        self.is_multi_gpu_board = 0
        self.L2_cache_size = int(info.get("L2_cache_size", 0))
        self.uuid = info.get("uuid", "")
        self.gcnArchName = "NVIDIA CUDA"
        self.warp_size = 32
        self.max_threads_per_multi_processor = 2048

    def __repr__(self) -> str:
        return (
            f"_CudaDeviceProperties(name='{self.name}', major={self.major}, "
            f"minor={self.minor}, total_memory={self.total_memory // (1 << 20)}MB, "
            f"multi_processor_count={self.multi_processor_count}, uuid={self.uuid}, "
            f"L2_cache_size={self.L2_cache_size // (1 << 20)}MB)"
        )


class _DeviceContext:
    """torch.cuda.device(i) / torch.accelerator.device_index(i)."""

    def __init__(self, device: Any) -> None:
        self.index = -1 if device is None else device_index(device)
        self.previous = -1

    @property
    def idx(self) -> int:
        """The device's index, as torch.cuda.device names it (-1: none)."""
        return self.index

    def __enter__(self) -> None:
        self.previous = DEVICES.current
        if self.index >= 0:
            DEVICES.current = self.index

    def __exit__(self, *exc: object) -> None:
        DEVICES.current = self.previous


def _set_device(device: Any) -> None:
    """Select a device (connecting to it)."""
    index = device_index(device)
    if index >= 0:
        DEVICES.channel(index)
        DEVICES.current = index


def _init() -> None:
    if DEVICES.in_bad_fork:
        raise RuntimeError(FORKED_CHILD)
    DEVICES.initialized = True


_STAT_FIGURES = (
    tuple(
        f"{metric}.{pool}.{figure}"
        for metric in (
            "allocated_bytes",
            "active_bytes",
            "requested_bytes",
            "reserved_bytes",
            "inactive_split_bytes",
            "allocation",
            "active",
            "segment",
            "inactive_split",
        )
        for pool in ("all", "large_pool", "small_pool")
        for figure in ("current", "peak", "allocated", "freed")
    )
    + tuple(
        f"{metric}.{figure}"
        for metric in ("oversize_allocations", "oversize_segments")
        for figure in ("current", "peak", "allocated", "freed")
    )
    + ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free")
)
"""Every figure of CUDA's `memory_stats`, which `memory_summary` reads (those the proxy server does
not keep are 0)."""  # fmt: skip


def _memory_stats(device: Any = None) -> dict[str, Any]:
    """`torch.cuda.memory_stats`: the server's figures, in CUDA's full layout."""
    stats = dict.fromkeys(_STAT_FIGURES, 0)
    stats["max_split_size"] = -1
    stats.update(device_figure(protocol.MEMORY_STATS, device))
    return dict(sorted(stats.items()))


def _set_memory_fraction(fraction: float, device: Any = None) -> None:
    """`torch.cuda.set_per_process_memory_fraction`: checked as CUDA checks it; the daemon, not the
    program, shares a device out."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    device_index(device)


class _Nvtx:
    """torch.cuda.nvtx's ranges and marks, which only a profiler of the real device would see."""

    def __init__(self) -> None:
        self.depth = 0
        self.started = 0

    def range_push(self, msg: str) -> int:
        self.depth += 1
        return self.depth - 1

    def range_pop(self) -> int:
        self.depth = max(0, self.depth - 1)
        return self.depth

    def range_start(self, msg: str) -> int:
        self.started += 1
        return self.started

    def range_end(self, range_id: int) -> None:
        pass

    def mark(self, msg: str) -> None:
        pass


def _memory_used(device: Any = None) -> int:
    """`torch.cuda.device_memory_used`: bytes in use on the device, as nvidia-smi counts them."""
    free, total = device_figure(protocol.MEMORY_INFO, device)
    return int(total - free)


def _gpu_processes(device: Any = None) -> str:
    """`torch.cuda.list_gpu_processes`: this process and what the device holds for it."""
    index = device_index(device)
    used = _memory_used(index) / (1024 * 1024)
    return f"GPU:{index}\nprocess {os.getpid():>10d} uses {used:>12.3f} MB GPU memory"


def _peer_access(device: Any, peer_device: Any) -> bool:
    """`torch.cuda.can_device_access_peer`: no proxied device maps another's memory (copies between
    them go through the host)."""
    count = len(DEVICES.paths)
    if not 0 <= device_index(device) < count:
        raise AssertionError("Invalid device id")
    if not 0 <= device_index(peer_device) < count:
        raise AssertionError("Invalid peer device id")
    return False


def patch_profiler() -> None:
    """Make the profiler, asked for CUDA activity, record this process's CPU activity only (with a
    warning), as it does where CUDA is unavailable: the kernels run in the proxy servers, and this
    CPU build's fallback for CUDA events would print a C++ error trace instead."""
    profile = torch.autograd.profiler.profile
    setup = profile.__init__
    states = torch._C._profiler.ProfilerState
    fallback = states.KINETO_GPU_FALLBACK

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        setup(self, *args, **kwargs)
        if self.use_device == "cuda" and self.profiler_kind == fallback:
            warnings.warn(
                "proxy: operations on proxied devices run in their proxy servers; the profiler "
                "records this process's CPU activity only",
                stacklevel=3,
            )
            self.use_device = None
            self.use_cuda = False
            self.profiler_kind = states.KINETO

    profile.__init__ = __init__  # type: ignore[method-assign]


def patch_nvtx() -> None:
    """Make torch.cuda.nvtx's functions (and its `range` context, built on them) work."""
    nvtx = _Nvtx()
    module = torch.cuda.nvtx
    for name in ("range_push", "range_pop", "range_start", "range_end", "mark"):
        setattr(module, name, getattr(nvtx, name))


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


_NO_SENSOR = 0
"""What NVML's sensor queries (temperature, power draw, clock rate) answer for a device that has no
sensor: a virtual device is the server's share of the host's CPUs."""


def _set_rng_state(new_state: Any, device: Any = "cuda") -> None:
    """`torch.cuda.set_rng_state`: proxied devices draw with the job's CPU generator (randomness.py)."""
    set_device_rng_state(new_state)


def _set_rng_state_all(new_states: Any) -> None:
    """`set_rng_state` with the current device's state: every proxied device draws from one generator."""
    states = list(new_states)
    if states:
        _set_rng_state(states[DEVICES.current if DEVICES.current < len(states) else 0])


def _fresh(func: Any) -> Any:
    """A distinct function object per patched name (torch._dynamo maps objects to names)."""
    if isinstance(func, type):
        return type(func.__name__, (func,), {})
    if isinstance(func, types.FunctionType):
        code, defaults, closure = func.__code__, func.__defaults__, func.__closure__
        copy = types.FunctionType(code, func.__globals__, func.__name__, defaults, closure)
        copy.__kwdefaults__ = func.__kwdefaults__
        return copy
    return func


CUDA_VERSION = "12.8"
"""`torch.version.cuda` in a job whose torch is built without CUDA: the devices answer as GPUs of
compute capability 8.0 do, and libraries check for a CUDA build before asking a device what it can
do (transformers' `tf32=True` was refused as needing an Ampere GPU)."""


def patch_cuda() -> None:
    """Make torch.cuda describe the proxied devices."""
    if torch.version.cuda is None:
        torch.version.cuda = CUDA_VERSION  # type: ignore[misc]
    cuda = torch.cuda
    count = len(DEVICES.paths)
    info = lambda device=None: DEVICES.channel(device_index(device)).info  # noqa: E731
    funcs: dict[str, Any] = {
        "is_available": lambda: True,
        "device_count": lambda: count,
        "current_device": lambda: DEVICES.current,
        "set_device": _set_device,
        "synchronize": lambda device=None: synchronize(None if device is None else device_index(device)),
        "init": _init,
        "_lazy_init": _init,
        "is_initialized": lambda: DEVICES.initialized,
        "_is_in_bad_fork": lambda: DEVICES.in_bad_fork,
        "get_device_name": lambda device=None: info(device)["name"],
        "get_device_properties": lambda device=None: _DeviceProperties(info(device)),
        "get_device_capability": lambda device=None: (
            int(info(device).get("major", 8)),
            int(info(device).get("minor", 0)),
        ),
        "get_arch_list": lambda: ["sm_80", "sm_90"],
        "is_bf16_supported": lambda including_emulation=True: True,
        "memory_allocated": lambda device=None: device_figure(protocol.MEMORY_ALLOCATED, device),
        "max_memory_allocated": lambda device=None: device_figure(protocol.MEMORY_PEAK, device),
        "memory_reserved": lambda device=None: device_figure(protocol.MEMORY_ALLOCATED, device),
        "max_memory_reserved": lambda device=None: device_figure(protocol.MEMORY_PEAK, device),
        "memory_stats": _memory_stats,
        "utilization": lambda device=None: device_figure(protocol.UTILIZATION, device),
        "set_per_process_memory_fraction": _set_memory_fraction,
        "mem_get_info": lambda device=None: device_figure(protocol.MEMORY_INFO, device),
        "memory_usage": lambda device=None: device_figure(protocol.UTILIZATION, device),
        "device_memory_used": _memory_used,
        "list_gpu_processes": _gpu_processes,
        "temperature": lambda device=None: _NO_SENSOR,
        "power_draw": lambda device=None: _NO_SENSOR,
        "clock_rate": lambda device=None: _NO_SENSOR,
        "can_device_access_peer": _peer_access,
        "set_sync_debug_mode": _no_op,
        "get_sync_debug_mode": lambda: 0,
        "reset_peak_memory_stats": lambda device=None: device_figure(protocol.MEMORY_RESET_PEAK, device),
        "reset_max_memory_allocated": lambda device=None: device_figure(protocol.MEMORY_RESET_PEAK, device),
        "reset_accumulated_memory_stats": _no_op,
        "empty_cache": _no_op,
        "ipc_collect": _no_op,
        "manual_seed": _no_op,
        "manual_seed_all": _no_op,
        "seed": _no_op,
        "seed_all": _no_op,
        "initial_seed": lambda: torch.initial_seed(),
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "get_rng_state_all": lambda: [torch.get_rng_state() for _ in range(count)],
        "set_rng_state": _set_rng_state,
        "set_rng_state_all": _set_rng_state_all,
        "default_generators": tuple(DeviceDefaultGenerator(index) for index in range(count)),
        "Stream": Stream,
        "Event": Event,
        "current_stream": device_stream,
        "default_stream": device_stream,
        "stream": StreamContext,
        "set_stream": _no_op,
        "device": _DeviceContext,
        "device_of": lambda obj: _DeviceContext(obj.device if obj.is_cuda else -1),
        "is_current_stream_capturing": lambda: False,
    }
    funcs = {name: _fresh(func) for name, func in funcs.items()}
    for name, func in funcs.items():
        setattr(cuda, name, func)
    for module_name in ("torch.cuda.memory", "torch.cuda.random", "torch.cuda.streams"):
        module = sys.modules.get(module_name)
        if module is not None:
            for name, func in funcs.items():
                if hasattr(module, name):
                    setattr(module, name, func)
    # On a CUDA build these would reach the driver; on a CPU build they must stay absent.
    if hasattr(torch._C, "_cuda_init"):
        torch._C._cuda_init = _init
    if hasattr(torch._C, "_cuda_getDeviceCount"):
        torch._C._cuda_getDeviceCount = lambda: count
    torch.backends.cudnn.is_acceptable = lambda tensor: False
    patch_library_choices()
    patch_nvtx()
    patch_profiler()
    patch_stream_class()
    patch_event_class()
    patch_record_stream()
    legacy_types.install()


CUFFT_PLAN_CACHE_MAX_SIZE = 4096
"""What `torch.backends.cuda.cufft_plan_cache.max_size` starts at on a GPU (CUDA 10 and later)."""


def patch_library_choices() -> None:
    """`torch.backends.cuda`'s choices of GPU libraries are taken and read back, as on a GPU (a CPU
    build of torch refuses them): the preferred linear-algebra and BLAS libraries, and the cuFFT
    plan cache's capacity (a device's operators run the host's kernels whatever is chosen)."""
    preferred = {
        "linalg": torch._C._get_linalg_preferred_backend(),
        "blas": torch._C._get_blas_preferred_backend(),
    }
    native: Any = torch._C
    native._set_linalg_preferred_backend = lambda backend: preferred.__setitem__("linalg", backend)
    native._get_linalg_preferred_backend = lambda: preferred["linalg"]
    native._set_blas_preferred_backend = lambda backend: preferred.__setitem__("blas", backend)
    native._get_blas_preferred_backend = lambda: preferred["blas"]
    capacities: dict[int, int] = {}

    def set_capacity(cache: Any, value: int) -> None:
        if int(value) < 0:
            raise RuntimeError(f"cuFFT plan cache size must be non-negative, but got {value}")
        capacities[cache.device_index] = int(value)

    plan_cache: Any = torch.backends.cuda.cuFFTPlanCache
    plan_cache.size = property(lambda cache: 0)
    plan_cache.max_size = property(
        lambda cache: capacities.get(cache.device_index, CUFFT_PLAN_CACHE_MAX_SIZE), set_capacity
    )
    plan_cache.clear = lambda cache: None


def patch_accelerator() -> None:
    """Make torch.accelerator describe the proxied devices as cuda."""
    accelerator = torch.accelerator
    funcs: dict[str, Any] = {
        "is_available": lambda: True,
        "current_accelerator": lambda check_available=False: torch.device("cuda"),
        "device_count": lambda: len(DEVICES.paths),
        "current_device_index": lambda: DEVICES.current,
        "current_device_idx": lambda: DEVICES.current,
        "set_device_index": _set_device,
        "set_device_idx": _set_device,
        "device_index": _DeviceContext,
        "synchronize": lambda device=None: synchronize(None if device is None else device_index(device)),
        "current_stream": device_stream,
        "set_stream": _no_op,
        "get_device_capability": lambda device=None: {"major": 8, "minor": 0},
        "empty_cache": _no_op,
        "memory_allocated": lambda device_index=None: device_figure(protocol.MEMORY_ALLOCATED, device_index),
        "max_memory_allocated": lambda device_index=None: device_figure(protocol.MEMORY_PEAK, device_index),
        "memory_reserved": lambda device_index=None: device_figure(protocol.MEMORY_ALLOCATED, device_index),
        "max_memory_reserved": lambda device_index=None: device_figure(protocol.MEMORY_PEAK, device_index),
        "memory_stats": lambda device_index=None: device_figure(protocol.MEMORY_STATS, device_index),
        "reset_peak_memory_stats": lambda device_index=None: device_figure(
            protocol.MEMORY_RESET_PEAK, device_index
        ),
        "reset_accumulated_memory_stats": _no_op,
        "get_memory_info": lambda device_index=None: device_figure(protocol.MEMORY_INFO, device_index),
    }
    funcs = {name: _fresh(func) for name, func in funcs.items()}
    # torch's Python asks this for the default device (FSDP's mesh, the default c10d backend)
    torch._C._get_accelerator = _fresh(lambda check_available=False: torch.device("cuda"))
    memory = sys.modules.get("torch.accelerator.memory")
    for name, func in funcs.items():
        setattr(accelerator, name, func)
        if memory is not None and hasattr(memory, name):
            setattr(memory, name, func)


class _GeneratorType(type(torch._C.Generator)):  # type: ignore[misc]
    """The type of torch.Generator in a job: every generator is one, torch's own CPU ones too."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, torch._C.Generator)

    def __subclasscheck__(cls, subclass: Any) -> bool:
        return issubclass(subclass, torch._C.Generator)


class Generator(torch._C.Generator, metaclass=_GeneratorType):
    """torch.Generator, which a job may also make for a proxied device: a CPU generator naming that
    device, since a job draws its devices' random numbers on the host with the generator it is
    given (randomness.py), as a direct CPU run draws them."""

    _proxied: torch.device | None = None

    def __new__(cls, device: Any = None) -> Generator:
        target = torch.device("cpu" if device is None else device)
        if target.type != "cuda":
            return super().__new__(cls, device=target)  # type: ignore[call-arg,no-any-return]
        generator = super().__new__(cls, device="cpu")  # type: ignore[call-arg]
        generator._proxied = torch.device("cuda", device_index(target))
        return generator  # type: ignore[no-any-return]

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._proxied or torch._C.Generator.device.__get__(self)  # type: ignore[attr-defined,no-any-return]

    def __reduce__(self) -> tuple[Any, ...]:
        """Copies and pickles keep the device (torch's own reduction rebuilds a CPU generator)."""
        _, _, state = super().__reduce__()
        return (Generator, (self.device,), state)


Generator.__module__ = "torch"


def patch_generator() -> None:
    """Let `torch.Generator(device="cuda")` make a generator for a proxied device."""
    torch.Generator = Generator  # type: ignore[misc]


def patch_autocast() -> None:
    """autocast('cuda') also casts stand-ins, whose C++ device is the host."""
    autocast = torch.amp.autocast_mode.autocast
    enter, exit_ = autocast.__enter__, autocast.__exit__

    def __enter__(self: Any) -> Any:
        entered = enter(self)
        if self.device == "cuda":
            self._sing_host_autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
            torch.set_autocast_enabled("cpu", self._enabled)
            torch.set_autocast_dtype("cpu", self.fast_dtype)
        return entered

    def __exit__(self: Any, *exc: Any) -> Any:
        if self.device == "cuda" and hasattr(self, "_sing_host_autocast"):
            torch.set_autocast_enabled("cpu", self._sing_host_autocast[0])
            torch.set_autocast_dtype("cpu", self._sing_host_autocast[1])
        return exit_(self, *exc)

    autocast.__enter__ = __enter__  # type: ignore[method-assign]
    autocast.__exit__ = __exit__  # type: ignore[method-assign]
