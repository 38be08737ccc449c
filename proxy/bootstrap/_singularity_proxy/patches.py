# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""Make torch in the job see the proxied devices as cuda:0..n-1 without touching CUDA."""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from . import client, wire
from .client import STATE, ProxyTensor, device_index, download, to_device, to_host, upload

_T = torch.Tensor
_PKG = __name__.rsplit(".", 1)[0]


def _is_cuda(d: Any) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, int) and not isinstance(d, bool)


def _from_torch_internals() -> bool:
    """Whether the caller of the torch function is torch's own Python code."""
    f: Any = sys._getframe(1)
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if not name.startswith(_PKG) and name != "torch.overrides":
            return bool(name.startswith("torch."))
        f = f.f_back
    return False


def _to(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    self = args[0]
    kw = dict(kwargs)
    copy = bool(kw.pop("copy", False))
    device, dtype, _non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **kw)
    is_proxy = isinstance(self, ProxyTensor)
    if device is None or device.type not in ("cuda", "cpu"):
        return func(*args, **kwargs)
    if device.type == "cuda":
        index = STATE.current if device.index is None else device.index
        if is_proxy and self._ch.index == index:
            if dtype is None and not copy and memory_format in (None, torch.preserve_format):
                return self
            return func(
                self,
                dtype=dtype or self.dtype,
                copy=copy,
                memory_format=memory_format or torch.preserve_format,
            )
        src = self
        if is_proxy:
            src = to_host(self)
        if dtype is not None and dtype != src.dtype:
            src = src.to(dtype)
        return to_device(src, index)
    # to the host
    if not is_proxy:
        return func(*args, **kwargs)
    if _from_torch_internals():
        # torch groups tensors by their C++ device, which is the host for stand-ins
        if dtype is None or dtype == self.dtype:
            return self.clone() if copy else self
        return func(self, dtype=dtype, copy=copy)
    out = to_host(self)
    if dtype is not None and dtype != out.dtype:
        out = out.to(dtype)
    return out


def _cuda(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    self = args[0]
    device = args[1] if len(args) > 1 else kwargs.get("device")
    index = device_index(device)
    if isinstance(self, ProxyTensor) and self._ch.index == index:
        return self
    src = to_host(self) if isinstance(self, ProxyTensor) else self
    return to_device(src, index)


def _cpu(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    if isinstance(args[0], ProxyTensor):
        return to_host(args[0])
    return func(*args, **kwargs)


def _numpy(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    self = args[0]
    if isinstance(self, ProxyTensor):
        force = kwargs.get("force", args[1] if len(args) > 1 else False)
        if force:
            return download(self.detach()).numpy()
        raise TypeError(
            f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to "
            "copy the tensor to host memory first."
        )
    return func(*args, **kwargs)


def _tolist(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    if isinstance(args[0], ProxyTensor):
        return download(args[0].detach()).tolist()
    return func(*args, **kwargs)


def _new_tensor(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    self = args[0]
    device = kwargs.get("device")
    if isinstance(self, ProxyTensor) or (device is not None and _is_cuda(device)):
        index = self._ch.index if device is None else device_index(device)
        kw = dict(kwargs)
        kw.pop("device", None)
        requires_grad = kw.pop("requires_grad", False)
        kw.setdefault("dtype", self.dtype)
        data = args[1]
        if isinstance(data, ProxyTensor):
            data = download(data.detach())
        out = upload(
            torch.tensor(data, **kw) if not isinstance(data, torch.Tensor) else data.detach().to(kw["dtype"]),
            index,
        )
        if requires_grad:
            out.requires_grad_(True)
        return out
    return func(*args, **kwargs)


def _pin_memory(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    return args[0]


def _is_pinned(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    return False


_SERVER_FACTORIES = {
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.eye,
    torch.arange,
    torch.linspace,
    torch.logspace,
    torch.empty_strided,
}


def _factory(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """A tensor-making call with device='cuda...'."""
    index = device_index(kwargs["device"])
    kw = dict(kwargs)
    if args and isinstance(args[0], ProxyTensor) and args[0]._ch.index == index:
        kw.pop("device")
        return func(*args, **kw)
    kw.pop("pin_memory", None)
    requires_grad = bool(kw.pop("requires_grad", False))
    if func in _SERVER_FACTORIES and not any(isinstance(a, torch.Tensor) for a in args):
        kw["device"] = "meta"
        meta = func(*args, **kw)
        ch = STATE.channel(index)
        h = ch.next_id
        ch.next_id = h + 1
        skw = dict(kw)
        skw["device"] = client._DEV
        op = (wire.OP_FACTORY, h, func.__name__, list(args), skw)
        nbytes = meta.numel() * meta.element_size()
        if nbytes >= ch.sync_bytes:
            ch.pending.append(op)
            try:
                ch.request((wire.REQ_SYNC,))
            except BaseException:
                ch.frees.append(h)
                raise
        else:
            ch.push(op)
        out = client.new_proxy(ch, h, (tuple(meta.shape), tuple(meta.stride()), 0, meta.dtype))
    else:
        kw["device"] = "cpu"
        local = func(*args, **kw)
        if not isinstance(local, torch.Tensor):
            return local
        out = upload(local, index)
    if requires_grad:
        out.requires_grad_(True)
    return out


_MODE_FUNCS: dict[Any, Callable[[Any, Sequence[Any], dict[str, Any]], Any]] = {
    _T.to: _to,
    _T.cuda: _cuda,
    _T.cpu: _cpu,
    _T.numpy: _numpy,
    _T.tolist: _tolist,
    _T.new_tensor: _new_tensor,
    _T.pin_memory: _pin_memory,
    _T.is_pinned: _is_pinned,
}


_MIX_OK = {
    _T.__getitem__,
    _T.__setitem__,
    _T.copy_,
    _T.index_put_,
    _T.index_put,
    torch.index_put,
    _T.__reduce_ex__,
    _T.__deepcopy__,
}


def _check_devices(args: Sequence[Any]) -> None:
    """Raise what CUDA raises when one call mixes cuda tensors and (non-scalar) host tensors."""
    dev = host = None
    for a in args:
        t = type(a)
        if t is list or t is tuple:
            for b in a:
                if isinstance(b, ProxyTensor):
                    dev = b if dev is None else dev
                elif isinstance(b, torch.Tensor) and b.dim() > 0:
                    host = b if host is None else host
        elif t is ProxyTensor:
            dev = a if dev is None else dev
        elif isinstance(a, torch.Tensor) and a.dim() > 0 and not isinstance(a, ProxyTensor):
            host = a if host is None else host
    if dev is None or _from_torch_internals():
        return
    for a in args:
        if isinstance(a, ProxyTensor) and a._ch is not dev._ch:
            raise client._same_device_error(str(dev.device), str(a.device))
    if host is not None:
        raise client._same_device_error(str(dev.device), str(host.device))


class DeviceMode(TorchFunctionMode):
    """Routes device placement (factories, .to, .cuda, .cpu) to the proxied devices."""

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        h = _MODE_FUNCS.get(func)
        if h is not None:
            return h(func, args, kwargs or {})
        if kwargs:
            d = kwargs.get("device")
            if d is not None and _is_cuda(d):
                return _factory(func, args, kwargs)
        if len(args) > 1 and func not in _MIX_OK:
            _check_devices(args)
        if kwargs:
            return func(*args, **kwargs)
        return func(*args)


# -- torch.cuda ---------------------------------------------------------------------------
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
        client.synchronize(self.device.index)

    def query(self) -> bool:
        client.synchronize(self.device.index)
        return True

    def is_capturing(self) -> bool:
        return False

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Event:
        ev = event if event is not None else Event()
        ev.record(self)
        return ev

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class Event:
    """A cuda event: recording it waits for the device, so timings are real."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self._t: float | None = None
        self._dev: int | None = None

    def record(self, stream: Any = None) -> None:
        self._dev = stream.device.index if stream is not None else STATE.current
        client.synchronize(self._dev)
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        if self._dev is not None:
            client.synchronize(self._dev)

    def query(self) -> bool:
        self.synchronize()
        return True

    def wait(self, stream: Any = None) -> None:
        pass

    def elapsed_time(self, end_event: Event) -> float:
        if self._t is None or end_event._t is None:
            raise RuntimeError(
                "CUDA error: device not ready\nBoth events must be recorded before calculating elapsed time."
            )
        return (end_event._t - self._t) * 1000.0


_STREAMS: dict[int, Stream] = {}


def _stream(device: Any = None) -> Stream:
    i = device_index(device)
    s = _STREAMS.get(i)
    if s is None:
        s = _STREAMS[i] = Stream(i)
    return s


class _StreamContext:
    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __enter__(self) -> Any:
        return self.stream

    def __exit__(self, *exc: object) -> None:
        pass


class _DeviceContext:
    """torch.cuda.device(i) / torch.accelerator.device_index(i)."""

    def __init__(self, device: Any) -> None:
        self.idx = -1 if device is None else device_index(device)
        self.prev = -1

    def __enter__(self) -> None:
        self.prev = STATE.current
        if self.idx >= 0:
            STATE.current = self.idx

    def __exit__(self, *exc: object) -> None:
        STATE.current = self.prev


def _memory(what: str, device: Any = None) -> Any:
    return STATE.channel(device_index(device)).request((wire.REQ_MEMORY, what))


def _set_device(device: Any) -> None:
    i = device_index(device)
    if i >= 0:
        STATE.channel(i)
        STATE.current = i


def _init() -> None:
    STATE.initialized = True


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def _fresh(f: Any) -> Any:
    """A distinct function object per patched name (torch._dynamo maps objects to names)."""
    if isinstance(f, type):
        return type(f.__name__, (f,), {})
    if isinstance(f, types.FunctionType):
        g = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
        g.__kwdefaults__ = f.__kwdefaults__
        return g
    return f


def _patch_cuda() -> None:
    cuda = torch.cuda
    n = len(STATE.paths)
    info = lambda d=None: STATE.channel(device_index(d)).info  # noqa: E731
    funcs: dict[str, Any] = {
        "is_available": lambda: True,
        "device_count": lambda: n,
        "current_device": lambda: STATE.current,
        "set_device": _set_device,
        "synchronize": lambda device=None: client.synchronize(
            None if device is None else device_index(device)
        ),
        "init": _init,
        "_lazy_init": _init,
        "is_initialized": lambda: STATE.initialized,
        "_is_in_bad_fork": lambda: False,
        "get_device_name": lambda device=None: info(device)["name"],
        "get_device_properties": lambda device=None: _DeviceProperties(info(device)),
        "get_device_capability": lambda device=None: (
            int(info(device).get("major", 8)),
            int(info(device).get("minor", 0)),
        ),
        "get_arch_list": lambda: ["sm_80", "sm_90"],
        "is_bf16_supported": lambda including_emulation=True: True,
        "memory_allocated": lambda device=None: _memory("allocated", device),
        "max_memory_allocated": lambda device=None: _memory("peak", device),
        "memory_reserved": lambda device=None: _memory("allocated", device),
        "max_memory_reserved": lambda device=None: _memory("peak", device),
        "memory_stats": lambda device=None: _memory("stats", device),
        "mem_get_info": lambda device=None: _memory("info", device),
        "reset_peak_memory_stats": lambda device=None: _memory("reset_peak", device),
        "reset_max_memory_allocated": lambda device=None: _memory("reset_peak", device),
        "reset_accumulated_memory_stats": _no_op,
        "empty_cache": _no_op,
        "ipc_collect": _no_op,
        "manual_seed": _no_op,
        "manual_seed_all": _no_op,
        "seed": _no_op,
        "seed_all": _no_op,
        "initial_seed": lambda: torch.initial_seed(),
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "get_rng_state_all": lambda: [torch.get_rng_state() for _ in range(n)],
        "set_rng_state": _no_op,
        "set_rng_state_all": _no_op,
        "Stream": Stream,
        "Event": Event,
        "current_stream": _stream,
        "default_stream": _stream,
        "stream": _StreamContext,
        "set_stream": _no_op,
        "device": _DeviceContext,
        "device_of": lambda obj: _DeviceContext(obj.device if obj.is_cuda else -1),
        "is_current_stream_capturing": lambda: False,
    }
    funcs = {name: _fresh(f) for name, f in funcs.items()}
    for name, f in funcs.items():
        setattr(cuda, name, f)
    for modname in ("torch.cuda.memory", "torch.cuda.random", "torch.cuda.streams"):
        mod = sys.modules.get(modname)
        if mod is not None:
            for name, f in funcs.items():
                if hasattr(mod, name):
                    setattr(mod, name, f)
    # On a CUDA build these would reach the driver; on a CPU build they must stay absent.
    if hasattr(torch._C, "_cuda_init"):
        torch._C._cuda_init = _init
    if hasattr(torch._C, "_cuda_getDeviceCount"):
        torch._C._cuda_getDeviceCount = lambda: n
    torch.backends.cudnn.is_acceptable = lambda tensor: False


def _patch_accelerator() -> None:
    acc = torch.accelerator
    funcs: dict[str, Any] = {
        "is_available": lambda: True,
        "current_accelerator": lambda check_available=False: torch.device("cuda"),
        "device_count": lambda: len(STATE.paths),
        "current_device_index": lambda: STATE.current,
        "current_device_idx": lambda: STATE.current,
        "set_device_index": _set_device,
        "set_device_idx": _set_device,
        "device_index": _DeviceContext,
        "synchronize": lambda device=None: client.synchronize(
            None if device is None else device_index(device)
        ),
        "current_stream": _stream,
        "set_stream": _no_op,
        "get_device_capability": lambda device=None: {"major": 8, "minor": 0},
        "empty_cache": _no_op,
        "memory_allocated": lambda device_index=None: _memory("allocated", device_index),
        "max_memory_allocated": lambda device_index=None: _memory("peak", device_index),
        "memory_reserved": lambda device_index=None: _memory("allocated", device_index),
        "max_memory_reserved": lambda device_index=None: _memory("peak", device_index),
        "memory_stats": lambda device_index=None: _memory("stats", device_index),
        "reset_peak_memory_stats": lambda device_index=None: _memory("reset_peak", device_index),
        "reset_accumulated_memory_stats": _no_op,
        "get_memory_info": lambda device_index=None: _memory("info", device_index),
    }
    funcs = {name: _fresh(f) for name, f in funcs.items()}
    mem = sys.modules.get("torch.accelerator.memory")
    for name, f in funcs.items():
        setattr(acc, name, f)
        if mem is not None and hasattr(mem, name):
            setattr(mem, name, f)


def _patch_autocast() -> None:
    """autocast('cuda') also casts stand-ins, whose C++ device is the host."""
    ac = torch.amp.autocast_mode.autocast
    enter, exit_ = ac.__enter__, ac.__exit__

    def __enter__(self: Any) -> Any:
        r = enter(self)
        if self.device == "cuda":
            self._sing_prev = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
            torch.set_autocast_enabled("cpu", self._enabled)
            torch.set_autocast_dtype("cpu", self.fast_dtype)
        return r

    def __exit__(self: Any, *exc: Any) -> Any:
        if self.device == "cuda" and hasattr(self, "_sing_prev"):
            torch.set_autocast_enabled("cpu", self._sing_prev[0])
            torch.set_autocast_dtype("cpu", self._sing_prev[1])
        return exit_(self, *exc)

    ac.__enter__ = __enter__  # type: ignore[method-assign]
    ac.__exit__ = __exit__  # type: ignore[method-assign]


# -- torch.save / torch.load ---------------------------------------------------------------
def _tagger(storage: Any) -> str | None:
    if getattr(storage, "device", None) is not None and storage.device.type == "cpu":
        return client.SAVE_TAGS.get(storage.data_ptr())
    return None


def _resolve(map_location: Any, location: str) -> str:
    if map_location is None:
        return location
    if isinstance(map_location, dict):
        return str(map_location.get(location, location))
    if isinstance(map_location, (str, torch.device)):
        return str(map_location)
    return location


def _patch_load() -> None:
    torch.serialization.register_package(1, _tagger, lambda obj, location: None)
    orig_load = torch.load

    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        targets: dict[int, str] = {}

        def restore(storage: Any, location: str) -> Any:
            if callable(map_location) and not isinstance(map_location, (dict, str, torch.device)):
                res = map_location(storage, location)
                if res is not None:
                    return res
                target = location
            else:
                target = _resolve(map_location, location)
            if target.startswith("cuda"):
                targets[storage.data_ptr()] = target
                return storage
            if target == "cpu" or target.startswith("cpu"):
                return storage
            return storage

        obj = orig_load(f, restore, *args, **kwargs)
        if not targets:
            return obj
        return _place(obj, targets, {})

    torch.load = load
    orig_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        try:
            orig_save(obj, f, *args, **kwargs)
        finally:
            client.end_save()

    torch.save = save


def _place(obj: Any, targets: dict[int, str], memo: dict[int, Any]) -> Any:
    """Move the loaded tensors whose storage was mapped to a cuda location onto it."""
    if id(obj) in memo:
        return memo[id(obj)]
    out: Any = obj
    if isinstance(obj, torch.Tensor) and not isinstance(obj, ProxyTensor):
        target = targets.get(obj.untyped_storage().data_ptr()) if obj.device.type == "cpu" else None
        if target is not None:
            with torch.no_grad():
                moved: Any = upload(obj.detach(), device_index(target))
            if isinstance(obj, torch.nn.Parameter):
                out = torch.nn.Parameter(moved, requires_grad=obj.requires_grad)
            else:
                out = moved.requires_grad_(obj.requires_grad) if obj.is_leaf else moved
    elif isinstance(obj, dict):
        items = [(k, _place(v, targets, memo)) for k, v in obj.items()]
        try:
            out = type(obj)(items)
        except Exception:
            out = dict(items)
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
    elif isinstance(obj, list):
        out = [_place(v, targets, memo) for v in obj]
    elif isinstance(obj, tuple):
        vals = [_place(v, targets, memo) for v in obj]
        out = type(obj)(*vals) if hasattr(obj, "_fields") else tuple(vals)
    elif isinstance(obj, torch.nn.Module):
        obj._apply(lambda t: _place(t, targets, memo))
    memo[id(obj)] = out
    return out


def install(paths: Sequence[str], job_id: str, rank: int, local_rank: int) -> None:
    """Install the client: patches, the global mode and the device list."""
    STATE.paths = list(paths)
    STATE.channels = [None] * len(paths)
    STATE.job_id = job_id
    STATE.rank = rank
    STATE.current = 0
    torch.__future__.set_swap_module_params_on_conversion(True)
    _patch_cuda()
    _patch_accelerator()
    _patch_autocast()
    _patch_load()
    mode = DeviceMode()
    mode.__enter__()
    _installed.append(mode)


_installed: list[DeviceMode] = []
