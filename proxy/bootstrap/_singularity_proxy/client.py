# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""In-job side of the device proxy: stand-in tensors whose data lives in a proxy server.

This module runs in the job's own interpreter, so it imports only the standard library
and torch. Every operation on a stand-in is queued and sent in batches; the program
waits only when it reads a value, as it would with a real CUDA device.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import wire

_CPU = torch.device("cpu")
_FLOAT = float
_DEV = "\x00sing-device"  # stands for "the server's device" inside encoded arguments
_BATCH_OPS = 64
_FD_BASE = 1000  # each device's connection lives at fd _FD_BASE + device index
_mk = torch.Tensor._make_wrapper_subclass


class ProxyError(RuntimeError):
    """The connection to a proxy server failed."""


class _Handle:
    """Owns one server-side tensor id; queues its release when the stand-in dies."""

    __slots__ = ("ch", "id")

    def __init__(self, ch: Channel, hid: int) -> None:
        self.ch = ch
        self.id = hid

    def __del__(self) -> None:
        try:  # noqa: SIM105 (hot path: no context manager)
            self.ch.frees.append(self.id)
        except Exception:
            pass


class Channel:
    """The connection of this process to the proxy server of one device."""

    def __init__(self, path: str, index: int, job_id: str, rank: int) -> None:
        self.index = index
        self.device = torch.device("cuda", index)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        fd = _FD_BASE + index
        os.dup2(s.fileno(), fd, inheritable=False)
        s.close()
        self.sock = socket.socket(fileno=fd)
        self.send_lock = threading.Lock()
        self.req_lock = threading.Lock()
        self.pending: list[tuple[Any, ...]] = []
        self.frees: list[int] = []
        self.next_id = 1
        self.op_ids: dict[Any, int] = {}
        self.cache: dict[Any, tuple[Any, int, int]] = {}
        self._reply: Any = None
        self._reply_ev = threading.Event()
        self._dead: BaseException | None = None
        wire.send_msg(self.sock, (wire.HELLO, job_id, rank, index, False))
        msg = wire.recv_msg(self.sock)
        if msg[0] == wire.ERROR:
            raise ProxyError(msg[3])
        self.info: dict[str, Any] = msg[1]
        self.sync_bytes = max(1 << 20, int(self.info["total_memory"]) // 64)
        self.peak_local = 0
        t = threading.Thread(target=self._reader, name=f"sing-proxy-{index}", daemon=True)
        t.start()

    # -- reader thread -------------------------------------------------------------
    def _deliver(self, msg: Any) -> None:
        self._reply = msg
        self._reply_ev.set()

    def _reader(self) -> None:
        try:
            while True:
                msg = wire.recv_msg(self.sock)
                if msg[0] == wire.PARK:
                    self._park()
                else:
                    self._deliver(msg)
        except BaseException as e:  # the server went away: wake any waiter with an error
            self._dead = e
            self._reply_ev.set()

    def _park(self) -> None:
        """Stop at an operation boundary: no message is half sent while parked."""
        with self.send_lock:
            wire.send_msg(self.sock, (wire.PARKED, self.req_lock.locked()))
            while True:
                msg = wire.recv_msg(self.sock)
                if msg[0] == wire.RESUME:
                    return
                if msg[0] == wire.PARK:
                    continue
                self._deliver(msg)

    # -- sending ---------------------------------------------------------------------
    def push(self, op: tuple[Any, ...]) -> None:
        """Queue one operation; send the queue when it is long enough."""
        p = self.pending
        p.append(op)
        if len(p) >= _BATCH_OPS:
            self.flush()

    def _take(self) -> list[tuple[Any, ...]]:
        ops = self.pending
        self.pending = []
        if self.frees:
            fr = self.frees
            self.frees = []
            ops.append((wire.OP_FREE, fr))
        return ops

    def flush(self) -> None:
        """Send every queued operation without waiting for it to run."""
        if self._dead is not None:
            raise ProxyError(f"proxy server for cuda:{self.index} is gone: {self._dead}")
        with self.send_lock:
            ops = self._take()
            if ops:
                wire.send_msg(self.sock, (wire.BATCH, ops, None))

    def request(self, req: tuple[Any, ...]) -> Any:
        """Send the queue and one request, wait for its answer, raise what the server raised."""
        with self.req_lock:
            if self._dead is not None:
                raise ProxyError(f"proxy server for cuda:{self.index} is gone: {self._dead}")
            self._reply_ev.clear()
            with self.send_lock:
                ops = self._take()
                wire.send_msg(self.sock, (wire.BATCH, ops, req))
            self._reply_ev.wait()
            msg = self._reply
            self._reply = None
            if msg is None:
                raise ProxyError(f"proxy server for cuda:{self.index} is gone: {self._dead}")
        if msg[0] == wire.ERROR:
            raise _rebuild_error(msg[1], msg[2], msg[3])
        return msg[1]

    def op_id(self, func: Any) -> int:
        oid = self.op_ids.get(func)
        if oid is None:
            oid = len(self.op_ids) + 1
            self.op_ids[func] = oid
            self.pending.append((wire.OP_DEF, oid, (func.namespace, func._opname, func._overloadname)))
        return oid


def _rebuild_error(module: str, qualname: str, message: str) -> BaseException:
    """Recreate the exception the server raised, with the same type and message."""
    obj: Any = sys.modules.get(module)
    if obj is None:
        try:
            obj = __import__(module, fromlist=["_"])
        except Exception:
            obj = None
    for part in qualname.split("."):
        obj = getattr(obj, part, None) if obj is not None else None
    if isinstance(obj, type) and issubclass(obj, BaseException):
        try:
            return obj(message)
        except Exception:
            pass
    return RuntimeError(message)


# -- global state ------------------------------------------------------------------------
class _State:
    """Devices given to this process and the one currently selected."""

    def __init__(self) -> None:
        self.channels: list[Channel | None] = []
        self.paths: list[str] = []
        self.job_id = ""
        self.rank = 0
        self.current = 0
        self.initialized = False
        self.lock = threading.Lock()

    def channel(self, index: int | None = None) -> Channel:
        i = self.current if index is None else index
        if i < 0 or i >= len(self.paths):
            raise RuntimeError(
                "CUDA error: invalid device ordinal\nCUDA kernel errors might be "
                "asynchronously reported at some other API call, so the stacktrace below "
                "might be incorrect."
            )
        ch = self.channels[i]
        if ch is None:
            with self.lock:
                ch = self.channels[i]
                if ch is None:
                    ch = Channel(self.paths[i], i, self.job_id, self.rank)
                    self.channels[i] = ch
        self.initialized = True
        return ch


STATE = _State()


def device_index(device: Any) -> int:
    """Index of a cuda device given as int, str or torch.device (None: current)."""
    if device is None:
        return STATE.current
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        return STATE.current if device.index is None else device.index
    return int(device)


# -- the stand-in tensor -----------------------------------------------------------------
def _same_device_error(a: str, b: str) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}!"
    )


class ProxyTensor(torch.Tensor):
    """A tensor on a proxied cuda device: metadata here, data in the proxy server."""

    _h: _Handle
    _hs: slice
    _key: tuple[Any, ...]
    _ch: Channel

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        return dispatch(func, args, kwargs)

    @property  # type: ignore[misc]
    def device(self) -> torch.device:  # type: ignore[override]
        return self._ch.device

    @property  # type: ignore[misc]
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property  # type: ignore[misc]
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False

    def get_device(self) -> int:  # type: ignore[override]
        return self._ch.index

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return _repr(self)

    def __reduce_ex__(self, proto: Any) -> Any:
        return _reduce(self, proto)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone()
        if self.requires_grad:
            new.requires_grad_(True)
        if getattr(self, "_is_param", False):
            new = torch.nn.Parameter(new, requires_grad=self.requires_grad)
        if self.grad is not None:
            new.grad = self.grad.__deepcopy__(memo)  # type: ignore[operator]
        memo[id(self)] = new
        return new


def new_proxy(ch: Channel, hid: int, meta: tuple[Any, ...]) -> ProxyTensor:
    """Make the stand-in for server tensor `hid` with meta (shape, stride, offset, dtype)."""
    t = _mk(ProxyTensor, meta[0], meta[1], meta[2], None, meta[3], torch.strided, _CPU)
    t._h = _Handle(ch, hid)
    t._hs = slice(hid)
    t._key = meta
    t._ch = ch
    return t  # type: ignore[no-any-return]


# -- encoding of arguments ---------------------------------------------------------------
def _enc_list(seq: Sequence[Any], parts: list[Any], ins: list[ProxyTensor]) -> list[Any]:
    out: list[Any] = []
    for a in seq:
        t = type(a)
        if t is ProxyTensor:
            ins.append(a)
            parts.append(a._key)
            out.append(a._hs)
        elif t is int or t is float or t is str or a is None:
            parts.append(a)
            out.append(a)
        else:
            out.append(_enc_other(a, t, parts, ins))
    return out


def _enc_other(a: Any, t: type, parts: list[Any], ins: list[ProxyTensor]) -> Any:
    if t is list or t is tuple:
        sub: list[Any] = []
        o = _enc_list(a, sub, ins)
        parts.append(tuple(sub))
        return o
    if t is bool:
        parts.append((bool, a))
        return a
    if isinstance(a, ProxyTensor):
        ins.append(a)
        parts.append(a._key)
        return a._hs
    if isinstance(a, torch.Tensor):
        # A host tensor reaching an operation on stand-ins: a scalar, or one that torch's
        # C++ made with the stand-in's (host) options. Mixing by the program is caught in
        # the torch-function mode, as the device would catch it.
        c = a.detach()
        if c.device.type != "cpu":
            raise _same_device_error("cuda:0", str(c.device))
        parts.append(("cpu", tuple(c.shape), tuple(c.stride()), c.dtype))
        c, raw = _raw(c)
        return ("t", c.dtype, tuple(c.shape), tuple(c.stride()), raw)
    if t is torch.device:
        parts.append(_DEV)
        return _DEV
    parts.append(a)
    return a


def _encode(
    args: Sequence[Any], kwargs: dict[str, Any] | None
) -> tuple[list[Any], dict[str, Any] | None, list[Any], list[ProxyTensor]]:
    parts: list[Any] = []
    ins: list[ProxyTensor] = []
    eargs: list[Any] = []
    for a in args:
        t = type(a)
        if t is ProxyTensor:
            ins.append(a)
            parts.append(a._key)
            eargs.append(a._hs)
        elif t is int or t is str or a is None:
            parts.append(a)
            eargs.append(a)
        elif t is float:
            parts.append(_FLOAT)
            eargs.append(a)
        else:
            eargs.append(_enc_other(a, t, parts, ins))
    ekw = None
    if kwargs:
        ekw = {}
        for k, v in kwargs.items():
            parts.append(k)
            t = type(v)
            if t is float:
                parts.append(_FLOAT)
                ekw[k] = v
            elif t is int or t is str or v is None:
                parts.append(v)
                ekw[k] = v
            else:
                ekw[k] = _enc_other(v, t, parts, ins)
    return eargs, ekw, parts, ins


# -- building outputs from a template ----------------------------------------------------
def _count_new(tpl: Any) -> tuple[int, int, bool]:
    """Number of new tensors, bytes of new storage, and whether a plain value is returned."""
    k = tpl[0]
    if k == "T":
        return 1, tpl[2], False
    if k in ("L", "U"):
        n = b = 0
        v = False
        for x in tpl[1]:
            n2, b2, v2 = _count_new(x)
            n += n2
            b += b2
            v = v or v2
        return n, b, v
    if k == "V":
        return 0, 0, True
    return 0, 0, False


def _build(tpl: Any, ch: Channel, ins: list[ProxyTensor], ctr: list[int]) -> Any:
    k = tpl[0]
    if k == "T":
        h = ctr[0]
        ctr[0] = h + 1
        return new_proxy(ch, h, tpl[1])
    if k == "A":
        return ins[tpl[1]]
    if k == "L":
        return [_build(x, ch, ins, ctr) for x in tpl[1]]
    if k == "U":
        return tuple(_build(x, ch, ins, ctr) for x in tpl[1])
    if k == "V":
        return tpl[1]
    return None


def _dynamic(func: Any, ins: list[ProxyTensor], args: Sequence[Any]) -> bool:
    tags = func.tags
    if torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags:
        if func is torch.ops.aten.index.Tensor:
            return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
        return True
    return False


def dispatch(func: Any, args: Sequence[Any], kwargs: dict[str, Any] | None) -> Any:
    """Forward one aten operation on stand-ins to the proxy server."""
    special = _SPECIAL.get(func)
    if special is not None:
        return special(func, args, kwargs or {})
    eargs, ekw, parts, ins = _encode(args, kwargs)
    ch = ins[0]._ch
    for p in ins:
        if p._ch is not ch:
            raise _same_device_error(str(ch.device), str(p._ch.device))
    key = (func, tuple(parts))
    entry = ch.cache.get(key)
    if entry is not None:
        tpl, n, nbytes = entry
        if nbytes < ch.sync_bytes:
            base = ch.next_id
            ch.next_id = base + n
            ch.push((wire.OP_CALL, ch.op_id(func), base, eargs, ekw))
            if tpl[0] == "T":
                return new_proxy(ch, base, tpl[1])
            return _build(tpl, ch, ins, [base])
    oid = ch.op_id(func)
    base = ch.next_id
    tpl = ch.request((wire.REQ_CALL, oid, base, eargs, ekw))
    n, nbytes, has_value = _count_new(tpl)
    ch.next_id = base + n
    if not has_value and not _dynamic(func, ins, args):
        ch.cache[key] = (tpl, n, nbytes)
    return _build(tpl, ch, ins, [base])


# -- transfers ---------------------------------------------------------------------------
def _raw(t: torch.Tensor) -> tuple[torch.Tensor, bytes]:
    """A dense CPU copy of t (same strides where t is dense) and the bytes of its storage."""
    c = torch.empty_like(t, device="cpu")
    c.copy_(t)
    flat = torch.empty(0, dtype=torch.uint8).set_(c.untyped_storage())
    return c, flat.numpy().tobytes()


def from_raw(dtype: torch.dtype, shape: Sequence[int], stride: Sequence[int], raw: bytes) -> Any:
    """Rebuild a CPU tensor from the bytes of its storage."""
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return torch.empty(0, dtype=dtype).set_(buf.untyped_storage(), 0, shape, stride)


def upload(t: torch.Tensor, index: int) -> ProxyTensor:
    """Copy a CPU tensor to cuda:index (no autograd)."""
    if isinstance(t, ProxyTensor):
        if t._ch.index == index:
            return t
        t = download(t)
    ch = STATE.channel(index)
    with torch.no_grad():
        c, raw = _raw(t.detach())
    h = ch.next_id
    ch.next_id = h + 1
    meta = (tuple(c.shape), tuple(c.stride()), 0, c.dtype)
    op = (wire.OP_UPLOAD, h, c.dtype, meta[0], meta[1], raw)
    if len(raw) >= ch.sync_bytes:
        ch.pending.append(op)
        ch.request((wire.REQ_SYNC,))
    else:
        ch.push(op)
    return new_proxy(ch, h, meta)


def download(p: torch.Tensor) -> Any:
    """Copy a stand-in's values into a new CPU tensor (waits for the device)."""
    assert isinstance(p, ProxyTensor)
    dtype, shape, stride, raw = p._ch.request((wire.REQ_FETCH, p._h.id))
    return from_raw(dtype, shape, stride, raw)


def fill(p: ProxyTensor, values: torch.Tensor) -> None:
    """Overwrite a stand-in's values with those of a CPU tensor of the same shape."""
    with torch.no_grad():
        c = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype)
        c.copy_(values)
        flat = torch.empty(0, dtype=torch.uint8).set_(c.untyped_storage())
    p._ch.push((wire.OP_FILL, p._h.id, c.dtype, tuple(c.shape), tuple(c.stride()), flat.numpy().tobytes()))


class _Upload(torch.autograd.Function):
    """Differentiable host-to-device copy."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, index: int) -> Any:
        ctx.dtype = t.dtype
        return upload(t, index)

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        return (download(g) if isinstance(g, ProxyTensor) else g), None


class _Download(torch.autograd.Function):
    """Differentiable device-to-host copy."""

    @staticmethod
    def forward(ctx: Any, p: ProxyTensor) -> Any:
        ctx.index = p._ch.index
        return download(p)

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        return upload(g, ctx.index)


def to_device(t: torch.Tensor, index: int) -> Any:
    """Host-to-device copy that autograd records when t requires grad."""
    if t.requires_grad and torch.is_grad_enabled():
        return _Upload.apply(t, index)
    return upload(t, index)


def to_host(p: ProxyTensor) -> Any:
    """Device-to-host copy that autograd records when p requires grad."""
    if p.requires_grad and torch.is_grad_enabled():
        return _Download.apply(p)
    return download(p)


def synchronize(index: int | None = None) -> None:
    """Wait until every operation queued for a device (or all devices) has run."""
    chans = STATE.channels if index is None else [STATE.channels[index]]
    for ch in chans:
        if ch is not None:
            ch.request((wire.REQ_SYNC,))


# -- operations handled in the client ----------------------------------------------------
aten = torch.ops.aten
_RANDOM_INPLACE = {
    aten.bernoulli_.float,
    aten.normal_.default,
    aten.uniform_.default,
    aten.random_.default,
    getattr(aten.random_, "from"),
    aten.random_.to,
    aten.exponential_.default,
    aten.geometric_.default,
    aten.log_normal_.default,
    aten.cauchy_.default,
}
_RANDOM_LIKE = {
    aten.rand_like.default,
    aten.randn_like.default,
    aten.randint_like.default,
    aten.randint_like.low_dtype,
}
_RANDOM_VALUES = {
    aten.bernoulli.default,
    aten.bernoulli.p,
    aten.bernoulli_.Tensor,
    aten.multinomial.default,
    aten.normal.Tensor_float,
    aten.normal.float_Tensor,
    aten.normal.Tensor_Tensor,
    aten.poisson.default,
    aten.randperm.default,
}


def _local_args(args: Sequence[Any], kwargs: dict[str, Any], empty: bool) -> tuple[Any, Any]:
    def conv(a: Any) -> Any:
        if isinstance(a, ProxyTensor):
            if empty:
                return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype)
            return download(a)
        if isinstance(a, (list, tuple)):
            return type(a)(conv(x) for x in a)
        if isinstance(a, torch.device):
            return _CPU
        return a

    return [conv(a) for a in args], {k: conv(v) for k, v in kwargs.items()}


def _random_inplace(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Draw the numbers with this process's CPU generator, as a direct CPU run would."""
    self = args[0]
    local = torch.empty_strided(self.shape, self.stride(), dtype=self.dtype)
    la, lk = _local_args(args[1:], kwargs, empty=False)
    func(local, *la, **lk)
    fill(self, local)
    return self


def _random_out(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    index = next(a for a in args if isinstance(a, ProxyTensor))._ch.index
    la, lk = _local_args(args, kwargs, empty=func in _RANDOM_LIKE)
    if func is aten.bernoulli_.Tensor:
        out = torch.empty_strided(args[0].shape, args[0].stride(), dtype=args[0].dtype)
        func(out, *la[1:], **lk)
        fill(args[0], out)
        return args[0]
    return upload(func(*la, **lk), index)


def _copy_(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    dst, src = args[0], args[1]
    if isinstance(dst, ProxyTensor) and not isinstance(src, ProxyTensor):
        fill(dst, src.expand(dst.shape))
        return dst
    if not isinstance(dst, ProxyTensor):
        dst.copy_(download(src))
        return dst
    if dst._ch is not src._ch:
        fill(dst, download(src).expand(dst.shape))
        return dst
    return _plain(func, args, kwargs)


def _plain(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    saved = _SPECIAL.pop(func)
    try:
        return dispatch(func, args, kwargs)
    finally:
        _SPECIAL[func] = saved


_SPECIAL: dict[Any, Callable[[Any, Sequence[Any], dict[str, Any]], Any]] = {}
for _f in _RANDOM_INPLACE:
    _SPECIAL[_f] = _random_inplace
for _f in _RANDOM_LIKE | _RANDOM_VALUES:
    _SPECIAL[_f] = _random_out
_SPECIAL[aten.copy_.default] = _copy_


# -- printing and saving -----------------------------------------------------------------
def _repr(p: ProxyTensor) -> str:
    from torch import _tensor_str

    with torch.no_grad():
        cpu = download(p)
    contents = "[]" if cpu.numel() == 0 else _tensor_str._tensor_str(cpu, len("tensor("))
    old = ProxyTensor.__name__
    ProxyTensor.__name__ = "tensor"
    try:
        s: str = _tensor_str._str(p, tensor_contents=contents)
    finally:
        ProxyTensor.__name__ = old
    if getattr(p, "_is_param", False):
        if s.startswith("Parameter(") and s.endswith(")"):
            s = s[len("Parameter(") : -1]
        return "Parameter containing:\n" + s
    return s


SAVE_TAGS: dict[int, str] = {}
SAVE_KEEP: list[torch.Tensor] = []  # keeps tagged host copies (and their pointers) alive


def end_save() -> None:
    """Forget the host copies made while pickling stand-ins."""
    SAVE_TAGS.clear()
    SAVE_KEEP.clear()


def _reduce(p: ProxyTensor, proto: Any) -> Any:
    """Pickle as a real cuda tensor would: data plus a 'cuda:N' location tag."""
    from collections import OrderedDict

    with torch.no_grad():
        cpu = download(p)
    ptr = cpu.untyped_storage().data_ptr()
    SAVE_TAGS[ptr] = str(p.device)
    SAVE_KEEP.append(cpu)
    if getattr(p, "_is_param", False):
        return (torch._utils._rebuild_parameter, (cpu, p.requires_grad, OrderedDict()))
    if p.requires_grad and p.is_leaf:
        cpu.requires_grad_(True)
    return cpu.__reduce_ex__(proto)
