# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""Collectives on proxied devices: queued on the channel like any operation, run by the servers.

A collective on stand-ins becomes one OP_COLLECTIVE on the channel of their device, naming the
c10d operator, the process group, its number in that group and the tensors' handles; the
servers of the job carry it out once every member reaches it (server/collectives.py). The
program gets a completed Work at once: what it does next is queued after the collective, so it
sees the result, as on a CUDA stream. A barrier, and a collective on host tensors that the
server must carry out (a group without a host backend), wait for the answer.

Collectives reach here three ways, all ending in `issue`: the process group that stands for
NCCL (process_group.py), c10d operators on stand-ins reaching `__torch_dispatch__` (a gloo group
given cuda tensors), and `_c10d_functional` operators on stand-ins (functional collectives,
DTensor, torch.compile).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import protocol
from .devices import DEVICES
from .tensor import ProxyTensor, SpecialHandler, download, forward
from .transfers import upload

REDUCE_NAMES = {
    int(dist.ReduceOp.SUM.value): "sum",
    int(dist.ReduceOp.AVG.value): "avg",
    int(dist.ReduceOp.PRODUCT.value): "product",
    int(dist.ReduceOp.MIN.value): "min",
    int(dist.ReduceOp.MAX.value): "max",
    int(dist.ReduceOp.BAND.value): "band",
    int(dist.ReduceOp.BOR.value): "bor",
    int(dist.ReduceOp.BXOR.value): "bxor",
    int(dist.ReduceOp.PREMUL_SUM.value): "premul_sum",
}
"""c10d's reduction codes, by the names the wire uses (protocol.REDUCE_OPS)."""


class GroupBook:
    """What the process knows of its process groups: wire names, numbering, devices."""

    def __init__(self) -> None:
        self.generation: dict[str, int] = {}
        """How many times each group name was destroyed (a re-created group is a new group)."""
        self.seq: dict[str, int] = {}
        """The number of the last collective issued in each group."""
        self.defined: dict[tuple[int, str], tuple[int, list[int]]] = {}
        """(device index, wire name) -> (rank, members) told to that device's server."""
        self.device: dict[str, int] = {}
        """The device of each group's collectives (a rank keeps one device per group)."""
        self.hint: int | None = None
        """The device a library is working on (DDP's parameters), for host tensors."""

    def key(self, group: Any) -> str:
        """The group's name on the wire: its c10d name and how often that name was destroyed."""
        name = str(group.group_name)
        return f"{name}.{self.generation.get(name, 0)}"

    def destroyed(self, names: Sequence[str]) -> None:
        """These groups were destroyed: collectives in a group of the same name are a new group."""
        for name in names:
            self.generation[name] = self.generation.get(name, 0) + 1


GROUPS = GroupBook()


def completed_work(result: Any) -> Any:
    """A Work that is already complete, whose future holds `result` (DDP reads `value()[0]`)."""
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(future)  # type: ignore[attr-defined]


def stand_ins(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in (nested lists of) tensors."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from stand_ins(item)


def _handles(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_handles(item) for item in value]
    return value._handle.id


def reduce_name(op: Any) -> tuple[str, float]:
    """The wire name and factor of a reduction (a ReduceOp, its RedOpType, or its script object)."""
    factor = 1.0
    code = op
    if isinstance(op, torch.ScriptObject):
        code = op.op()  # type: ignore[attr-defined]
    elif isinstance(op, dist.ReduceOp):
        code = op.op  # type: ignore[attr-defined]
        if code == dist.ReduceOp.PREMUL_SUM:
            factor = float(op.factor)
    if hasattr(code, "value"):
        code = code.value
    return REDUCE_NAMES[int(code)], factor


def issue(
    group: Any, operator: str, *, wait: bool = False, pair: tuple[int, int] | None = None, **spec: Any
) -> None:
    """Send a collective on stand-ins (all on one device) to the group's servers to carry out.

    `spec` holds `tensors`, `inputs`, `outputs` (stand-ins, or lists of them) and options
    (protocol.COLLECTIVE_SPEC); with `wait`, return only once the collective has completed.
    With `pair` (source, destination: global ranks) it runs in the group of those two ranks that
    stands for the point-to-point messages from one to the other (`post`).
    """
    if pair is None:
        flush_point_to_point()  # what was sent before this collective goes first, as on a stream
    tensors: list[Any] = [t for key in ("tensors", "inputs", "outputs") for t in stand_ins(spec.get(key, []))]
    key = GROUPS.key(group) if pair is None else f"{GROUPS.key(group)}/p2p/{pair[0]}>{pair[1]}"
    channel = tensors[0]._channel if tensors else DEVICES.channel(GROUPS.device.get(key))
    for tensor in tensors:
        if tensor._channel is not channel:
            found = f"{channel.device} and {tensor.device}"
            raise ValueError(f"Expected all tensors of a collective on one device, but found {found}")
    known = GROUPS.device.setdefault(key, channel.index)
    if known != channel.index:
        raise RuntimeError(
            f"proxy: this rank ran collectives of process group {group.group_name!r} on cuda:{known} "
            f"and now on {channel.device}: a rank keeps one device for the collectives of a group"
        )
    me = dist.get_rank()
    members = dist.get_process_group_ranks(group) if pair is None else list(pair)
    if GROUPS.defined.get((channel.index, key)) != (me, members):
        GROUPS.defined[(channel.index, key)] = (me, members)
        channel.push([protocol.OP_GROUP, key, me, members])
    seq = GROUPS.seq[key] = GROUPS.seq.get(key, 0) + 1
    body = {
        name: _handles(value) if name in ("tensors", "inputs", "outputs") else value
        for name, value in spec.items()
    }
    if wait:
        channel.request([protocol.REQ_COLLECTIVE, key, seq, operator, body])
    else:
        channel.push([protocol.OP_COLLECTIVE, key, seq, operator, body])
        channel.flush()  # the other ranks wait for it: sent now, whatever this rank blocks in next


# -- point-to-point messages -----------------------------------------------------------------------
class _Message:
    """A send or receive posted by the program and not yet issued."""

    def __init__(self, group: Any, source: int, destination: int, tensor: Any) -> None:
        self.group, self.source, self.destination, self.tensor = group, source, destination, tensor


_POSTED: list[_Message] = []


def post(group: Any, tensors: Sequence[Any], peer: int, sending: bool) -> Any:
    """A send of a stand-in to group rank `peer`, or a receive into one from it; its Work.

    For the servers, a message from rank s to rank d is a broadcast from s in a group of those two
    ranks alone (one such group per direction of each pair, numbered like any group), so it takes
    part in the consistent cut of collectives: at a checkpoint it has happened for both ranks or for
    neither. A posted message is held here until the program waits for one of them (or issues a
    collective, or destroys a group); then every held one is issued, ordered by (source, destination)
    as every rank orders them. NCCL runs such a batch at once, so an exchange in both directions
    (`batch_isend_irecv`, a ring's isend then recv) cannot wait on itself; ordered so, the message
    that comes first everywhere always has both its ranks at it. A blocking send to a rank that is
    itself blocked sending back waits for ever, as it does with NCCL beyond its buffers.
    """
    if len(tensors) != 1:
        raise ValueError(f"proxy: a point-to-point message carries one tensor, not {len(tensors)}")
    if not isinstance(tensors[0], ProxyTensor):
        raise ValueError("Tensors must be CUDA and dense")
    me = dist.get_rank()
    other = dist.get_process_group_ranks(group)[peer]
    if other == me:
        role = "destination" if sending else "source"
        raise ValueError(f"Invalid {role} rank: should not be the same as the rank of the current process.")
    source, destination = (me, other) if sending else (other, me)
    _POSTED.append(_Message(group, source, destination, tensors[0]))
    return _PostedWork(list(tensors), peer)


def flush_point_to_point() -> None:
    """Issue every held message, ordered by (source, destination) (stable: one pair's in turn)."""
    if not _POSTED:
        return
    posted = sorted(_POSTED, key=lambda m: (m.source, m.destination))
    _POSTED.clear()
    for message in posted:
        pair = (message.source, message.destination)
        issue(message.group, "c10d::broadcast_", pair=pair, tensors=[message.tensor], root=0)


class _PostedWork(dist.Work):
    """The Work of a posted message: waiting for it issues the held messages (what follows in the
    program is queued after them, so it sees what they received)."""

    def __init__(self, tensors: list[Any], peer: int) -> None:
        super().__init__()
        self._tensors = tensors
        self._peer = peer

    def wait(self, timeout: Any = None) -> bool:
        flush_point_to_point()
        return True

    def is_completed(self) -> bool:
        flush_point_to_point()
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> Any:
        return None

    def result(self) -> list[Any]:
        return [t() if isinstance(t, weakref.ref) else t for t in self._tensors]

    def hold_tensors_weakly(self) -> None:
        """Let the tensors go when the program drops them (this Work is kept for C++: _BOXED_WORKS)."""
        self._tensors = [weakref.ref(t) for t in self._tensors]

    def _source_rank(self) -> int:
        return self._peer

    def synchronize(self) -> None:
        flush_point_to_point()

    def get_future(self) -> Any:
        flush_point_to_point()
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_result(self.result())
        return future


def on_host(group: Any, operator: str, **spec: Any) -> None:
    """Carry out a collective on host tensors through the proxies (a group without a host backend).

    The tensors travel to the group's device and back; the call waits for the result.
    """
    index = GROUPS.device.get(GROUPS.key(group))
    if index is None:
        index = GROUPS.hint if GROUPS.hint is not None else DEVICES.current
    moved: dict[int, tuple[torch.Tensor, ProxyTensor]] = {}

    def to_device(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [to_device(item) for item in value]
        stand_in = upload(value, index)
        moved[id(stand_in)] = (value, stand_in)
        return stand_in

    issue(
        group,
        operator,
        **{k: to_device(v) if k in ("tensors", "inputs", "outputs") else v for k, v in spec.items()},
    )
    for host, stand_in in moved.values():
        with torch.no_grad():
            host.copy_(download(stand_in))


# -- c10d operators on stand-ins (a gloo group, or torch's C++ calling the group) ----------------
_GLOO_TYPE_ERROR = (
    "ProcessGroupGloo::{name}: invalid tensor type at index {index} (expected TensorOptions(dtype={dtype}, "
    "device={expected}, layout=Strided, requires_grad=false (default), pinned_memory=false (default), "
    "memory_format=(nullopt)), got TensorOptions(dtype={dtype}, device={found}, layout=Strided, "
    "requires_grad=false (default), pinned_memory=false (default), memory_format=(nullopt)))"
)


def check_same_kind(name: str, value: Any, group: Any) -> None:
    """Raise what torch raises when one collective mixes cuda and host tensors."""
    tensors = list(stand_ins(value))
    devices = {isinstance(t, ProxyTensor) for t in tensors}
    if len(devices) < 2:
        return
    if getattr(group, "proxies_nccl", False):
        raise ValueError("Tensors must be CUDA and dense")
    first = tensors[0]
    index, odd = next(
        (i, t) for i, t in enumerate(tensors) if isinstance(t, ProxyTensor) != isinstance(first, ProxyTensor)
    )
    dtype = str(first.dtype).removeprefix("torch.")
    raise RuntimeError(
        _GLOO_TYPE_ERROR.format(name=name, index=index, dtype=dtype, expected=first.device, found=odd.device)
    )


def _pg(value: Any) -> Any:
    return dist.ProcessGroup.unbox(value) if isinstance(value, torch.ScriptObject) else value


def _c10d(operator: str, unpack: Any, *, work_only: bool = False) -> SpecialHandler:
    """A dispatch handler for a c10d operator: `unpack(args)` -> (group, spec, result).

    The operator returns (result, work), or only the work when `work_only`.
    """

    def handle(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        bound = list(args) + [kwargs[a.name] for a in func._schema.arguments[len(args) :] if a.name in kwargs]
        group, spec, result = unpack(bound)
        group = _pg(group)
        check_same_kind(
            operator.removeprefix("c10d::").rstrip("_"),
            [spec.get(k, []) for k in ("tensors", "inputs", "outputs")],
            group,
        )
        issue(group, operator, **spec)
        work = completed_work(result if isinstance(result, list) else [result])
        return work.boxed() if work_only else (result, work.boxed())

    return handle


def _message(sending: bool) -> SpecialHandler:
    """A dispatch handler for `c10d::send` / `c10d::recv_` of a stand-in on a host group (gloo):
    posted as on a proxied NCCL group (`post`)."""

    def handle(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        tensors, group, peer = args[0], _pg(args[1]), args[2]
        check_same_kind("send" if sending else "recv", tensors, group)
        work = post(group, list(tensors), peer, sending)
        work.hold_tensors_weakly()
        _BOXED_WORKS.append(work)
        return work.boxed()

    return handle


_BOXED_WORKS: list[_PostedWork] = []
"""Posted works handed to torch's C++ (a host group's send and receive). C++ reaches their `wait`
only while the Python object lives (else it blocks in the base Work's), and it may call it any
time; they are kept, holding no tensors, until the process groups are destroyed."""


def release_boxed_works() -> None:
    """Forget the posted works handed to C++ (every process group is gone)."""
    _BOXED_WORKS.clear()


def _receive_from_any_source(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    raise RuntimeError(RECEIVE_FROM_ANY_SOURCE)


RECEIVE_FROM_ANY_SOURCE = "proxy: a receive from any source is not served on proxied devices (nor by NCCL)"


def _reduce(op: Any) -> dict[str, Any]:
    name, factor = reduce_name(op)
    return {"op": name, "factor": factor} if name == "premul_sum" else {"op": name}


C10D_OPS: dict[Any, SpecialHandler] = {
    torch.ops.c10d.allreduce_.default: _c10d(
        "c10d::allreduce_", lambda a: (a[1], {"tensors": a[0], **_reduce(a[2])}, a[0])
    ),
    torch.ops.c10d.allreduce_coalesced_.default: _c10d(
        "c10d::allreduce_coalesced_",
        lambda a: (a[1], {"tensors": a[0], **_reduce(a[2])}, a[0]),
        work_only=True,
    ),
    torch.ops.c10d.broadcast_.default: _c10d(
        "c10d::broadcast_", lambda a: (a[1], {"tensors": a[0], "root": a[2]}, a[0])
    ),
    torch.ops.c10d.allgather_.default: _c10d(
        "c10d::allgather_", lambda a: (a[2], {"outputs": a[0], "inputs": a[1]}, a[0])
    ),
    torch.ops.c10d._allgather_base_.default: _c10d(
        "c10d::_allgather_base_", lambda a: (a[2], {"outputs": [a[0]], "inputs": [a[1]]}, a[0])
    ),
    torch.ops.c10d.allgather_into_tensor_coalesced_.default: _c10d(
        "c10d::allgather_into_tensor_coalesced_",
        lambda a: (a[2], {"outputs": a[0], "inputs": a[1]}, a[0]),
        work_only=True,
    ),
    torch.ops.c10d.reduce_scatter_.default: _c10d(
        "c10d::reduce_scatter_", lambda a: (a[2], {"outputs": a[0], "inputs": a[1], **_reduce(a[3])}, a[0])
    ),
    torch.ops.c10d._reduce_scatter_base_.default: _c10d(
        "c10d::_reduce_scatter_base_",
        lambda a: (a[2], {"outputs": [a[0]], "inputs": [a[1]], **_reduce(a[3])}, a[0]),
    ),
    torch.ops.c10d.reduce_scatter_tensor_coalesced_.default: _c10d(
        "c10d::reduce_scatter_tensor_coalesced_",
        lambda a: (a[2], {"outputs": a[0], "inputs": a[1], **_reduce(a[3])}, a[0]),
        work_only=True,
    ),
    torch.ops.c10d.reduce_.default: _c10d(
        "c10d::reduce_",
        lambda a: (a[1], {"tensors": a[0], **_reduce(a[2]), "root": a[3]}, a[0]),
        work_only=True,
    ),
    torch.ops.c10d.gather_.default: _c10d(
        "c10d::gather_",
        lambda a: (a[2], {"outputs": a[0], "inputs": a[1], "root": a[3]}, a[0]),
        work_only=True,
    ),
    torch.ops.c10d.scatter_.default: _c10d(
        "c10d::scatter_", lambda a: (a[2], {"outputs": a[0], "inputs": a[1], "root": a[3]}, a[0])
    ),
    torch.ops.c10d.alltoall_.default: _c10d(
        "c10d::alltoall_", lambda a: (a[2], {"outputs": [a[0]], "inputs": [a[1]]}, a[0])
    ),
    torch.ops.c10d.alltoall_base_.default: _c10d(
        "c10d::alltoall_base_",
        lambda a: (
            a[2],
            {"outputs": [a[0]], "inputs": [a[1]], "output_splits": list(a[3]), "input_splits": list(a[4])},
            a[0],
        ),
        work_only=True,
    ),
    torch.ops.c10d.send.default: _message(sending=True),
    torch.ops.c10d.recv_.default: _message(sending=False),
    torch.ops.c10d.recv_any_source_.default: _receive_from_any_source,
}
"""c10d operators on stand-ins, as they reach `__torch_dispatch__`."""


# -- functional collectives (_c10d_functional) on stand-ins --------------------------------------
def _resolve(name: str) -> Any:
    return torch._C._distributed_c10d._resolve_process_group(name)  # type: ignore[arg-type]


def _new(like: torch.Tensor, rows: int) -> Any:
    """A new stand-in like `like` with `rows` rows."""
    return forward(torch.ops.aten.new_empty.default, (like, [rows, *like.shape[1:]]), None)


def _clone(tensor: torch.Tensor) -> Any:
    return forward(torch.ops.aten.clone.default, (tensor,), None)


def _functional_all_reduce(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    tensor, op, name = args[0], args[1], args[2]
    out = tensor if func is torch.ops._c10d_functional.all_reduce_.default else _clone(tensor)
    issue(_resolve(name), "c10d::allreduce_", tensors=[out], op=str(op).lower())
    return out


def _functional_all_reduce_coalesced(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    tensors, op, name = list(args[0]), args[1], args[2]
    inplace = func is torch.ops._c10d_functional.all_reduce_coalesced_.default
    outs = tensors if inplace else [_clone(t) for t in tensors]
    issue(_resolve(name), "c10d::allreduce_coalesced_", tensors=outs, op=str(op).lower())
    return outs


def _functional_all_gather(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    tensor, size, name = args[0], int(args[1]), args[2]
    out = kwargs.get("out") if "out" in kwargs else (args[3] if len(args) > 3 else None)
    out = out if out is not None else _new(tensor, tensor.shape[0] * size if tensor.dim() else size)
    issue(_resolve(name), "c10d::_allgather_base_", outputs=[out], inputs=[tensor])
    return out


def _functional_all_gather_coalesced(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    tensors, size, name = list(args[0]), int(args[1]), args[2]
    outs = [_new(t, t.shape[0] * size) for t in tensors]
    issue(_resolve(name), "c10d::allgather_into_tensor_coalesced_", outputs=outs, inputs=tensors)
    return outs


def _functional_reduce_scatter(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    tensor, op, size, name = args[0], args[1], int(args[2]), args[3]
    out = kwargs.get("out") if "out" in kwargs else (args[4] if len(args) > 4 else None)
    out = out if out is not None else _new(tensor, tensor.shape[0] // size)
    issue(_resolve(name), "c10d::_reduce_scatter_base_", outputs=[out], inputs=[tensor], op=str(op).lower())
    return out


def _functional_reduce_scatter_coalesced(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    tensors, op, size, name = list(args[0]), args[1], int(args[2]), args[3]
    outs = [_new(t, t.shape[0] // size) for t in tensors]
    issue(
        _resolve(name),
        "c10d::reduce_scatter_tensor_coalesced_",
        outputs=outs,
        inputs=tensors,
        op=str(op).lower(),
    )
    return outs


def _functional_all_to_all(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    tensor, output_splits, input_splits, name = args[0], list(args[1]), list(args[2]), args[3]
    rows = sum(output_splits) if output_splits else tensor.shape[0]
    out = _new(tensor, rows)
    issue(
        _resolve(name), "c10d::alltoall_base_", outputs=[out], inputs=[tensor],
        output_splits=output_splits, input_splits=input_splits,
    )  # fmt: skip
    return out


def _functional_broadcast(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    tensor, src, name = args[0], int(args[1]), args[2]
    out = tensor if func is torch.ops._c10d_functional.broadcast_.default else _clone(tensor)
    group = _resolve(name)
    issue(group, "c10d::broadcast_", tensors=[out], root=src)
    return out


def _wait_tensor(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    return args[0]  # ordered on the device: nothing to wait for


def _no_op(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    return None


FUNCTIONAL_OPS: dict[str, SpecialHandler] = {
    "all_reduce": _functional_all_reduce,
    "all_reduce_": _functional_all_reduce,
    "all_reduce_coalesced": _functional_all_reduce_coalesced,
    "all_reduce_coalesced_": _functional_all_reduce_coalesced,
    "all_gather_into_tensor": _functional_all_gather,
    "all_gather_into_tensor_out": _functional_all_gather,
    "all_gather_into_tensor_coalesced": _functional_all_gather_coalesced,
    "reduce_scatter_tensor": _functional_reduce_scatter,
    "reduce_scatter_tensor_out": _functional_reduce_scatter,
    "reduce_scatter_tensor_coalesced": _functional_reduce_scatter_coalesced,
    "all_to_all_single": _functional_all_to_all,
    "broadcast": _functional_broadcast,
    "broadcast_": _functional_broadcast,
    "wait_tensor": _wait_tensor,
    "_wrap_tensor_autograd": _wait_tensor,
}
"""Functional collectives on stand-ins, by operator name (the namespace is `_c10d_functional`)."""


def functional_op(func: Any) -> SpecialHandler | None:
    """The handler of a `_c10d_functional` operator (those not served raise at the server)."""
    return FUNCTIONAL_OPS.get(func._opname)


def python_kernel(func: Any) -> SpecialHandler:
    """Run a library's own Python kernel (FSDP's copy-in, chunk-cat) on stand-ins, op by op."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)

    def run(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        return func.redispatch(keys, *args, **kwargs)

    return run


NAMESPACES: dict[str, Any] = {"_c10d_functional": functional_op, "fsdp": python_kernel}
"""Namespaces whose operators on stand-ins the client carries out (tensor.namespace_ops)."""
SPECIAL_OPS: dict[Any, SpecialHandler] = {**C10D_OPS, torch.ops.aten.record_stream.default: _no_op}
"""c10d operators, and `record_stream` (streams have no meaning here)."""
