# mypy: disable-error-code="no-untyped-call,no-untyped-def,unused-ignore,override,misc"
# mypy: disable-error-code="attr-defined,assignment,call-arg,name-defined,method-assign"
"""The "nccl" of a job on proxied devices: a process group whose collectives the proxies run.

`init_process_group("nccl")` (and "cuda:nccl,cpu:gloo", the accelerator's default backend,
`new_group(backend="nccl")`, a bare `init_process_group()`) gets a `ProxyGroup`, a Python
`ProcessGroup` that torch takes for ProcessGroupNCCL. Its collectives on stand-ins are queued
on the device's channel (collectives.py); host tensors go to a real gloo backend when the
program asked for one ("cpu:gloo"), else through the proxies and back (torch's own C++, such as
DDP's parameter check, hands it host tensors: a stand-in's C++ device is the host).

`install` also makes DDP's C++ Reducer allocate its gradient buckets as stand-ins (with host
buckets the stand-in gradients would never be copied in: NaN losses), and tells torch that
NCCL is there. Only the standard library and torch are imported.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

from . import collectives
from .collectives import (
    GROUPS,
    RECEIVE_FROM_ANY_SOURCE,
    check_same_kind,
    completed_work,
    flush_point_to_point,
    issue,
    on_host,
    post,
    reduce_name,
    release_boxed_works,
    stand_ins,
)
from .devices import DEVICES
from .tensor import ProxyTensor, namespace_ops, new_stand_in, special_ops

NCCL_VERSION = (2, 21, 5)
"""What `torch.cuda.nccl.version()` answers (the c10d logger asks on every failing call)."""

_creating = threading.local()
"""The backend string of the group `_new_process_group_helper` is making (for its host backend)."""


class Options:
    """What torch sets on ProcessGroupNCCL.Options; kept, not used."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.is_high_priority_stream = False
        self._timeout = datetime.timedelta(minutes=10)
        self.global_ranks_in_group: list[int] = []
        self.group_name = ""
        self.split_from: Any = None
        self.split_color = 0
        self.config = type("Config", (), {"cta_policy": 0})()


class DeviceBackend:
    """What `group._get_backend(cuda)` answers: the capabilities torch asks about (none)."""

    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False
    options = Options()

    def supports_tensor_alloc(self, device: Any) -> bool:
        return False

    def name(self) -> str:
        return "nccl"


def _host_backend_wanted() -> bool:
    spec = str(getattr(_creating, "backend", "") or "").lower()
    return any(part.strip() in ("cpu:gloo",) for part in spec.split(","))


class ProxyGroup(dist.ProcessGroup):
    """A process group whose collectives on proxied devices the job's proxy servers carry out."""

    Options = Options
    NCCL_CTA_POLICY_ZERO = 0
    proxies_nccl = True

    def __init__(self, store: Any, rank: int, size: int, options: Any = None) -> None:
        super().__init__(rank, size)  # (the store-taking constructor has no Python subclasses)
        self.options = options or Options()
        self._name = ""
        self._description = ""
        self._host: Any = None
        if _host_backend_wanted():
            timeout = getattr(self.options, "_timeout", datetime.timedelta(minutes=10))
            self._host = dist.ProcessGroupGloo(dist.PrefixStore("sing-cpu/", store), rank, size, timeout)
            self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._host)

    # -- what torch asks of a ProcessGroupNCCL ------------------------------------------------------
    def _set_sequence_number_for_group(self) -> None:
        pass

    def getBackendName(self) -> str:
        return "nccl"

    def _set_group_name(self, name: str) -> None:  # a Python group keeps its own name
        self._name = name

    @property
    def group_name(self) -> str:
        if not self._name:
            raise RuntimeError("ProcessGroup name not set")
        return self._name

    def _set_group_desc(self, description: str) -> None:
        self._description = description

    @property
    def group_desc(self) -> str:
        return self._description

    def name(self) -> str:
        return "nccl"

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cuda")] + ([torch.device("cpu")] if self._host is not None else [])

    def _get_backend(self, device: Any) -> Any:
        if torch.device(device).type == "cpu":
            if self._host is None:
                raise RuntimeError("No backend type associated with device type cpu")
            return self._host
        return DeviceBackend()

    def _start_coalescing(self, device: Any) -> None:
        pass

    def _end_coalescing(self, device: Any) -> Any:
        return completed_work([])

    def shutdown(self) -> None:
        pass

    def abort(self) -> None:
        pass

    # -- collectives ---------------------------------------------------------------------------------
    def _run(self, operator: str, host: Any, result: Any, wait: bool = False, **spec: Any) -> Any:
        """Carry out one collective: on the proxies for stand-ins, else on the host backend, else
        through the proxies and back. `host()` runs it on the host backend."""
        tensors = [spec.get(k, []) for k in ("tensors", "inputs", "outputs")]
        check_same_kind(operator, tensors, self)
        if any(isinstance(t, ProxyTensor) for t in stand_ins(tensors)):
            _check_as_nccl(spec)
            issue(self, operator, wait=wait, **spec)
        elif self._host is not None:
            return host()
        elif any(True for _ in stand_ins(tensors)) or wait:
            on_host(self, operator, **spec)
        return completed_work(result)

    def allreduce(self, tensors, opts=None):
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._run(
            "c10d::allreduce_", lambda: self._host.allreduce(tensors, opts), tensors,
            tensors=tensors, **_reduction(opts.reduceOp),
        )  # fmt: skip

    def allreduce_coalesced(self, tensors, opts=None):
        tensors = list(tensors)
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._run(
            "c10d::allreduce_coalesced_", lambda: self._host.allreduce_coalesced(tensors, opts),
            tensors, tensors=tensors, **_reduction(opts.reduceOp),
        )  # fmt: skip

    def broadcast(self, tensors, opts=None):
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self._run(
            "c10d::broadcast_", lambda: self._host.broadcast(tensors, opts), tensors,
            tensors=tensors, root=opts.rootRank,
        )  # fmt: skip

    def reduce(self, tensors, opts=None):
        tensors = list(tensors)
        opts = opts if opts is not None else dist.ReduceOptions()
        return self._run(
            "c10d::reduce_", lambda: self._host.reduce(tensors, opts), tensors,
            tensors=tensors, root=opts.rootRank, **_reduction(opts.reduceOp),
        )  # fmt: skip

    def allgather(self, outputs, inputs, opts=None):
        outputs, inputs = [list(o) for o in outputs], list(inputs)
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._run(
            "c10d::allgather_", lambda: self._host.allgather(outputs, inputs, opts), outputs,
            outputs=outputs, inputs=inputs,
        )  # fmt: skip

    def all_gather_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._run(
            "c10d::_allgather_base_", lambda: self._host._allgather_base(output, input, opts),
            [output], outputs=[output], inputs=[input],
        )  # fmt: skip

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        outputs, inputs = list(outputs), list(inputs)
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._run(
            "c10d::allgather_into_tensor_coalesced_",
            lambda: _each(self._host._allgather_base, outputs, inputs, opts),
            outputs, outputs=outputs, inputs=inputs,
        )  # fmt: skip

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, outputs, inputs, opts=None):
        outputs, inputs = [list(o) for o in outputs], list(inputs)
        opts = opts if opts is not None else dist.GatherOptions()
        return self._run(
            "c10d::gather_", lambda: self._host.gather(outputs, inputs, opts), outputs,
            outputs=outputs, inputs=inputs, root=opts.rootRank,
        )  # fmt: skip

    def scatter(self, outputs, inputs, opts=None):
        outputs, inputs = list(outputs), [list(i) for i in inputs]
        opts = opts if opts is not None else dist.ScatterOptions()
        return self._run(
            "c10d::scatter_", lambda: self._host.scatter(outputs, inputs, opts), outputs,
            outputs=outputs, inputs=inputs, root=opts.rootRank,
        )  # fmt: skip

    def reduce_scatter(self, outputs, inputs, opts=None):
        outputs, inputs = list(outputs), [list(i) for i in inputs]
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._run(
            "c10d::reduce_scatter_", lambda: self._host.reduce_scatter(outputs, inputs, opts),
            outputs, outputs=outputs, inputs=inputs, **_reduction(opts.reduceOp),
        )  # fmt: skip

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._run(
            "c10d::_reduce_scatter_base_",
            lambda: self._host._reduce_scatter_base(output, input, opts),
            [output], outputs=[output], inputs=[input], **_reduction(opts.reduceOp),
        )  # fmt: skip

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        outputs, inputs = list(outputs), list(inputs)
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._run(
            "c10d::reduce_scatter_tensor_coalesced_",
            lambda: _each(self._host._reduce_scatter_base, outputs, inputs, opts),
            outputs, outputs=outputs, inputs=inputs, **_reduction(opts.reduceOp),
        )  # fmt: skip

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        output_splits, input_splits = list(output_splits or []), list(input_splits or [])
        return self._run(
            "c10d::alltoall_base_",
            lambda: self._host.alltoall_base(output, input, output_splits, input_splits, opts),
            [output], outputs=[output], inputs=[input],
            output_splits=output_splits, input_splits=input_splits,
        )  # fmt: skip

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        outputs, inputs = list(outputs), list(inputs)
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._run(
            "c10d::alltoall_", lambda: self._host.alltoall(outputs, inputs, opts), outputs,
            outputs=[outputs], inputs=[inputs],
        )  # fmt: skip

    def barrier(self, opts=None):
        issue(self, "c10d::barrier", wait=True)
        return completed_work([])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        return self.barrier()

    def send(self, tensors, dst, tag=0):
        return self._message(list(tensors), dst, tag, sending=True)

    def recv(self, tensors, src, tag=0):
        return self._message(list(tensors), src, tag, sending=False)

    def _message(self, tensors, peer, tag, sending):
        """A point-to-point message: through the proxies for stand-ins (NCCL has no tags either),
        else on the host backend."""
        if any(isinstance(t, ProxyTensor) for t in tensors) or self._host is None:
            return post(self, tensors, peer, sending)
        return (self._host.send if sending else self._host.recv)(tensors, peer, tag)

    def recv_anysource(self, tensors, tag=0):
        raise RuntimeError(RECEIVE_FROM_ANY_SOURCE)


def _each(call: Any, outputs: Sequence[Any], inputs: Sequence[Any], opts: Any) -> Any:
    """A coalesced collective on the host backend, one pair at a time (gloo has no coalesced form)."""
    works = [call(output, input, opts) for output, input in zip(outputs, inputs, strict=True)]
    for work in works[:-1]:
        work.wait()
    return works[-1] if works else completed_work([])


def _dense(tensor: torch.Tensor) -> bool:
    """Whether a tensor is contiguous in the memory format its strides suggest (NCCL's test)."""
    if tensor.is_contiguous():
        return True
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    return tensor.dim() in formats and tensor.is_contiguous(memory_format=formats[tensor.dim()])


_BITWISE = ("band", "bor", "bxor")


def _check_as_nccl(spec: dict[str, Any]) -> None:
    """Refuse what NCCL's process group refuses before it starts a collective on device tensors:
    a tensor it hands to NCCL as it is (not one it copies through a flat buffer) that is not
    dense, a bitwise reduction, an average of booleans."""
    single = [*spec.get("tensors", [])]
    single += [t for key in ("inputs", "outputs") for t in spec.get(key, []) if isinstance(t, torch.Tensor)]
    if not all(_dense(tensor) for tensor in single):
        raise ValueError("Tensors must be contiguous")
    op = spec.get("op")
    if op in _BITWISE:
        raise ValueError(f"Cannot use ReduceOp.{op.upper()} with NCCL")
    if op == "avg" and any(tensor.dtype == torch.bool for tensor in single):
        raise TypeError("Cannot use ReduceOp.AVG with boolean inputs")


def _reduction(op: Any) -> dict[str, Any]:
    name, factor = reduce_name(op)
    return {"op": name, "factor": factor} if name == "premul_sum" else {"op": name}


# -- DDP's gradient buckets ----------------------------------------------------------------------
class _BucketsOnDevice(TorchDispatchMode):
    """While DDP's Reducer allocates its buckets: floating host `empty` becomes a stand-in."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default):
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            device = kwargs.get("device")
            if dtype.is_floating_point and (device is None or torch.device(device).type == "cpu"):
                return _device_empty(self.index, func, args, kwargs)
        return func(*args, **kwargs)


def _device_empty(index: int, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`empty` on the proxied device `index`, as a stand-in."""
    from . import protocol

    meta = func(*args, **{**kwargs, "device": "meta"})
    channel = DEVICES.channel(index)
    handle = channel.new_handle()
    layout = [protocol.torch_names().dtype_names[meta.dtype], list(meta.shape), list(meta.stride())]
    channel.push([protocol.OP_ALLOCATE, handle, *layout])
    return new_stand_in(channel, handle, (tuple(meta.shape), tuple(meta.stride()), 0, meta.dtype))


def _module_device(parameters: Any) -> int | None:
    for parameter in parameters:
        if isinstance(parameter, ProxyTensor):
            return parameter._channel.index
    return None


@contextlib.contextmanager
def _buckets_for(parameters: Any) -> Iterator[None]:
    index = _module_device(parameters)
    if index is None:
        yield
        return
    with _BucketsOnDevice(index):
        yield


class ProxyReducer(dist.Reducer):
    """DDP's Reducer, allocating its gradient buckets on the parameters' proxied device."""

    def __init__(self, params, *args, **kwargs) -> None:
        self._sing_params = list(params)
        with _buckets_for(self._sing_params):
            super().__init__(self._sing_params, *args, **kwargs)

    def _rebuild_buckets(self) -> bool:
        with _buckets_for(self._sing_params):
            return bool(super()._rebuild_buckets())


@contextlib.contextmanager
def _device_hint(module: Any) -> Iterator[None]:
    """While DDP sets up: host collectives go to the module's device (its C++ device is the host)."""
    previous = GROUPS.hint
    index = _module_device(module.parameters()) if module is not None else None
    GROUPS.hint = index if index is not None else previous
    try:
        yield
    finally:
        GROUPS.hint = previous


# -- installing ----------------------------------------------------------------------------------
def install() -> None:
    """Make torch.distributed give "nccl" groups served by the proxies, and DDP work on stand-ins."""
    c10d.ProcessGroupNCCL = ProxyGroup
    c10d._NCCL_AVAILABLE = True
    if not isinstance(c10d.default_pg_nccl_timeout, datetime.timedelta):  # NCCL's default: 10 minutes
        c10d.default_pg_nccl_timeout = datetime.timedelta(minutes=10)
    dist.is_nccl_available = c10d.is_nccl_available = lambda: True
    dist.ProcessGroupNCCL = ProxyGroup
    torch.cuda.nccl.version = lambda: NCCL_VERSION
    torch.cuda.nccl.is_available = lambda tensors: False  # its direct calls are not served: sums copy
    dist.Reducer = ProxyReducer
    special_ops.update(collectives.SPECIAL_OPS)
    namespace_ops.update(collectives.NAMESPACES)

    helper = c10d._new_process_group_helper

    def new_process_group_helper(*args: Any, **kwargs: Any) -> Any:
        previous = getattr(_creating, "backend", None)
        _creating.backend = args[3] if len(args) > 3 else kwargs.get("backend")
        try:
            return helper(*args, **kwargs)
        finally:
            _creating.backend = previous

    c10d._new_process_group_helper = new_process_group_helper

    destroy = c10d.destroy_process_group

    def destroy_process_group(group: Any = None) -> None:
        if group is None or group == c10d.GroupMember.WORLD:
            names = [str(name) for name in c10d._world.pg_names.values()]
        else:
            names = [str(c10d._world.pg_names.get(group, ""))]
        flush_point_to_point()
        destroy(group)
        GROUPS.destroyed(names)
        if group is None or group == c10d.GroupMember.WORLD:
            release_boxed_works()

    c10d.destroy_process_group = dist.destroy_process_group = destroy_process_group

    from torch.nn.parallel import distributed as ddp

    ddp_init = ddp.DistributedDataParallel.__init__

    def ddp_setup(self: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        with _device_hint(module):
            ddp_init(self, module, *args, **kwargs)

    ddp.DistributedDataParallel.__init__ = ddp_setup
