"""Runs a session's operations and answers its requests, in order, one at a time on the device.

The session's thread (runner.py) hands it the plain operations of a frame; collectives run
elsewhere (collectives.py). Operations in a batch are not answered: the first failure is kept in
the session and reported at its next request, the way CUDA reports asynchronous errors at the next sync.
Everything in a batch comes from the job and is checked before use: a malformed operation,
a handle the session does not hold, a layout reaching outside its bytes or an allocation
past the device's capacity fails that operation only.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from singularity.proxy.bootstrap._singularity_proxy import numerics, protocol
from singularity.proxy.bootstrap._singularity_proxy.protocol import ProtocolError

from .busy import BusyTime
from .device_memory import DeviceMemory
from .outputs import (
    check_within_storages,
    layout_of,
    meta_growth,
    raw_values,
    resized_outputs,
    template_new_bytes,
)
from .session import Session, sparse_parts
from .squash import MISS, Call, Squash
from .writes import covers_its_storage, note_writes, out_of_place, written_tensors

_FACTORIES = frozenset(protocol.SERVER_FACTORIES)
_NOT_READING = frozenset(
    (protocol.OP_RUN, protocol.OP_CALL, protocol.OP_FREE, protocol.OP_PLAN, protocol.OP_DEFINE,
     protocol.OP_ALLOCATE, protocol.OP_UPLOAD, protocol.OP_SETTINGS)
)  # fmt: skip
"""Operations that touch no stored bytes outside an operator call (which brings back its own)."""
_OVERWRITING = frozenset(
    (torch.ops.aten.copy_.default, torch.ops.aten.fill_.Scalar, torch.ops.aten.fill_.Tensor,
     torch.ops.aten.zero_.default)
)  # fmt: skip
"""In-place operators whose result never depends on the bytes their first argument held."""
_NAMES = protocol.torch_names()
_HOST_ALLOCATION_FAILED = re.compile(
    r"DefaultCPUAllocator: can't allocate memory: you tried to allocate (\d+) bytes"
)
_SERVER_SETTINGS = numerics.current()
"""The server's own numeric settings (torch's defaults), read before any session's are applied."""


def _use_settings(session: Session) -> None:
    """Run the session's operations with its process's numeric settings (torch's are the server
    process's: each job process may have set its own)."""
    if session.settings is not None:
        numerics.apply(session.settings)


def _restore_settings(session: Session) -> None:
    """Back to the server's own numeric settings after the session's operations."""
    if session.settings is not None:
        numerics.apply(_SERVER_SETTINGS)


def _operation(op: Any, length: int) -> list[Any]:
    """An operation or request of the expected length; ProtocolError otherwise."""
    if type(op) is not list or len(op) != length:
        raise ProtocolError(f"malformed operation {str(op)[:100]}")
    return op


class Executor:
    """Runs operations for the sessions of one device, one at a time."""

    def __init__(self, device: torch.device, memory: DeviceMemory[Session]) -> None:
        self.device = device
        self.memory = memory
        self.lock = threading.RLock()
        """Held while anything runs on the device (operations, saves, loads) or changes what it holds
        (a session dropped); reentrant, since a load that fails drops what it made."""
        self.operations = 0
        """Operations run since the server started (the daemon's metrics report the rate)."""
        self.batches = 0
        """Batches run since the server started."""
        self.busy = BusyTime()
        """Time spent running batches and answering requests (a virtual device's utilisation)."""
        self.squash: Squash | None = None
        """Operations of spliced ranks run once on this device (squash.py); set by the server."""

    # -- arguments and outputs --------------------------------------------------------------------
    def _decode(self, session: Session, arg: Any, inputs: list[int], buffers: Sequence[Any]) -> Any:
        """An argument as the operator takes it: handles become the session's tensors."""
        kind = type(arg)
        if kind is dict:
            handle = arg.get(protocol.TAG_HANDLE)
            if handle is not None and len(arg) == 1:
                tensor = session.tensor(handle)
                inputs.append(handle)
                return tensor
            host = arg.get(protocol.TAG_HOST_TENSOR)
            if host is not None and len(arg) == 1:
                dtype, shape, stride, index = _operation(host, 4)
                values = protocol.tensor_from_raw(dtype, shape, stride, protocol.buffer_at(buffers, index))
                return values.to(self.device, copy=True)
            if arg == protocol.DEVICE_MARKER:
                return self.device
            return protocol.decode_tag(arg, buffers)
        if kind is list:
            return [self._decode(session, item, inputs, buffers) for item in arg]
        return arg

    def _decode_all(
        self, session: Session, args: Any, kwargs: Any, inputs: list[int], buffers: Sequence[Any]
    ) -> tuple[list[Any], dict[str, Any]]:
        """Positional and keyword arguments of an operation, decoded."""
        if type(args) is not list or (kwargs is not None and type(kwargs) is not dict):
            raise ProtocolError("arguments must be a list and keyword arguments an object")
        decoded = [self._decode(session, arg, inputs, buffers) for arg in args]
        named = {k: self._decode(session, v, inputs, buffers) for k, v in kwargs.items()} if kwargs else {}
        return decoded, named

    def _template(
        self,
        session: Session,
        output: Any,
        inputs: list[int],
        next_handle: list[int],
        new_handles: list[int],
    ) -> Any:
        """The output template of `output`, holding its new tensors under the next handles."""
        if isinstance(output, torch.Tensor):
            tensors = session.tensors
            for position, handle in enumerate(inputs):
                if output is tensors[handle]:
                    return [protocol.TEMPLATE_ALIAS, position]
            handle = next_handle[0]
            next_handle[0] = handle + 1
            session.claim_handle(handle)
            nbytes = session.add(handle, output)
            new_handles.append(handle)
            dtype = _NAMES.dtype_names[output.dtype]
            if output.layout != torch.strided:
                layout = str(output.layout).removeprefix("torch.")
                return [protocol.TEMPLATE_SPARSE, layout, list(output.shape), dtype, nbytes]
            return [protocol.TEMPLATE_TENSOR, *layout_of(output), dtype, nbytes]
        if isinstance(output, list):
            items = [self._template(session, o, inputs, next_handle, new_handles) for o in output]
            return [protocol.TEMPLATE_LIST, items]
        if isinstance(output, tuple):
            items = [self._template(session, o, inputs, next_handle, new_handles) for o in output]
            return [protocol.TEMPLATE_TUPLE, items]
        if output is None:
            return [protocol.TEMPLATE_NONE]
        if isinstance(output, (bool, int, float, complex, str)):
            return [protocol.TEMPLATE_VALUE, output]
        return [protocol.TEMPLATE_VALUE, repr(output)]

    # -- operations -------------------------------------------------------------------------------
    def _call(self, session: Session, op: list[Any], buffers: Sequence[Any]) -> Any:
        """Run a defined operator ([kind, op_id, first handle, args, kwargs]); its output template."""
        _, op_id, first_handle, args, kwargs = _operation(op, 5)
        served = session.operator(op_id)
        inputs: list[int] = []
        decoded_args, decoded_kwargs = self._decode_all(session, args, kwargs, inputs, buffers)
        return self._execute(session, served, decoded_args, decoded_kwargs, inputs, first_handle)

    def _execute(
        self, session: Session, served: Any, args: list[Any], kwargs: dict[str, Any], inputs: list[int],
        first_handle: Any,
    ) -> Any:  # fmt: skip
        """Run a served operator on decoded arguments; its output template (new tensors held)."""
        if served.size_argument is not None:
            self._check_planned(session, served, args, kwargs)
        call, output = self._reused(session, served.operator, args, kwargs)
        ran = output is MISS
        layouts_before = [layout_of(session.tensors[h]) for h in inputs] if served.resizes_outputs else None
        if ran:
            self._note_lead(session, call)
            output = self._run_operator(session, served, served.operator, args, kwargs)
        new_handles: list[int] = []
        try:
            template = self._template(session, output, inputs, [protocol.integer(first_handle)], new_handles)
        except BaseException:
            for handle in new_handles:
                session.free(handle)
            raise
        if new_handles:
            session.check_capacity(new_handles, sum(template_new_bytes(template)))
        if served.reshapes_input and template[0] == protocol.TEMPLATE_ALIAS:
            template = [protocol.TEMPLATE_RESHAPED, template[1], *layout_of(output)]
        if layouts_before is not None:
            template = resized_outputs(template, layouts_before, [session.tensors[h] for h in inputs])
        if served.rebinds_input:
            for handle in set(inputs):
                session.rebind(handle)
        if served.grows_inputs:
            growth = sum(session.recount(handle) for handle in set(inputs))
            if growth > 0:
                session.check_capacity([], growth)
        if ran and call is not None and self.squash is not None:
            self.squash.record(session, call, output)
        return template

    def _run_plan(self, session: Session, op: list[Any], buffers: Sequence[Any], answer: bool) -> Any:
        """Run a plan ([kind, plan_id, first handle, values]); its output template if `answer`."""
        _, plan_id, first_handle, values = _operation(op, 4)
        plan = session.planned(plan_id)
        args, kwargs, inputs = plan.bind(session, values, buffers, self.device)
        if answer or plan.general:
            return self._execute(session, plan.served, args, kwargs, inputs, first_handle)
        if plan.served.size_argument is not None:
            self._check_planned(session, plan.served, args, kwargs)
        call, output = self._reused(session, plan.served.operator, args, kwargs)
        ran = output is MISS
        if ran:
            self._note_lead(session, call)
            output = self._run_operator(session, plan.served, plan.call, args, kwargs)
        new_handles: list[int] = []
        added = self._keep(session, output, inputs, [protocol.integer(first_handle)], new_handles)
        if added:
            session.check_capacity(new_handles, added)
        if ran and call is not None and self.squash is not None:
            self.squash.record(session, call, output)
        return None

    def _keep(
        self, session: Session, output: Any, inputs: list[int], next_handle: list[int], new_handles: list[int]
    ) -> int:
        """Hold an output's new tensors under the next handles (as `_template` does); bytes added."""
        if type(output) is torch.Tensor:
            tensors = session.tensors
            for handle in inputs:
                if output is tensors[handle]:
                    return 0
            handle = next_handle[0]
            next_handle[0] = handle + 1
            session.claim_handle(handle)
            new_handles.append(handle)
            return session.add(handle, output)
        if type(output) is tuple or type(output) is list:
            added = 0
            try:
                for item in output:
                    added += self._keep(session, item, inputs, next_handle, new_handles)
            except BaseException:
                for handle in new_handles:
                    session.free(handle)
                new_handles.clear()
                raise
            return added
        return 0

    def _note_lead(self, session: Session, call: Call | None) -> None:
        """Before a call runs that squashing follows: whether every storage it uses is shared with
        another rank here, so that the others will be squashed onto what it makes (an update of
        replicated state: they should follow closely, pace.py)."""
        if call is not None and self.memory.shared:
            shared = self.memory.is_shared
            call.led = session.led = all(shared(leaf.key) for leaf in call.leaves)

    def _reused(
        self, session: Session, operator: Any, args: list[Any], kwargs: dict[str, Any]
    ) -> tuple[Call | None, Any]:
        """The call as squashing sees it (None where it does not take part) and its output made
        from another session's run of it, or MISS when it must run."""
        squash = self.squash
        if squash is None or not squash.active(session):
            return None, MISS
        call = squash.prepare(operator, args, kwargs)
        if call is None:
            return None, MISS
        return call, squash.reuse(session, call)

    def _run_operator(
        self, session: Session, served: Any, function: Any, args: list[Any], kwargs: dict[str, Any]
    ) -> Any:
        """Run a served operator (`function`: it or its bare kernel), its written storages the
        session's own first (their value ids void: squash.py records them anew after a call it
        follows)."""
        operator = served.operator
        output = MISS
        checked = session.shrunk_storages and served.touches_elements
        if session.swapped or checked:
            leaves = tree_leaves((args, kwargs))
            if session.swapped:  # its storages moved to host memory while it waited: the call uses them
                if operator in _OVERWRITING and leaves and type(leaves[0]) is torch.Tensor:
                    session.swap_in_overwritten(leaves[0], leaves[1:])
                session.swap_in_tensors(leaves)
            if checked:
                check_within_storages(leaves)
        if self.memory.shared:
            output = self._write_apart(session, operator, args, kwargs)
            if output is MISS:
                self._own_written(session, operator, args, kwargs)
        try:
            if output is MISS:
                output = function(*args, **kwargs)
        except RuntimeError as e:
            raise self._as_out_of_memory(session, e) from None
        finally:
            note_writes(operator, args, kwargs)  # for pre-copies (writes.py)
            if self.memory.values and self.squash is not None:
                self.squash.wrote(written_tensors(operator, args, kwargs))
        return output

    def _write_apart(self, session: Session, operator: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """Run an in-place operator (a pointwise update, `copy_`) whose tensor is the whole of a
        storage the session shares (it would otherwise be copied first) or one squashing keeps
        for the other sessions (what they are about to be squashed onto): out of place (writes.py
        `out_of_place`), its result's storage becoming the session's (the others keep the old
        bytes). The operator's output; MISS where it does not apply (then nothing ran)."""
        functional = out_of_place(operator)
        target = args[0] if functional is not None and args else None
        if (
            type(target) is not torch.Tensor
            or target.layout is not torch.strided
            or target.is_conj()
            or target.is_neg()
        ):
            return MISS
        storage = target.untyped_storage()
        key = storage._cdata
        keeps = self.memory.keeps
        wanted = self.memory.is_shared(key) or (keeps is not None and keeps(key))
        if not (wanted and covers_its_storage(target) and key in session.storages):
            return MISS
        session.check_room(storage.nbytes())
        try:
            result = functional(*args, **kwargs)
        except RuntimeError as e:
            raise self._as_out_of_memory(session, e) from None
        layout = (target.dtype, target.shape, target.stride(), storage.nbytes())
        if type(result) is not torch.Tensor or (
            (result.dtype, result.shape, result.stride(), result.untyped_storage().nbytes()) != layout
        ):
            return MISS  # another type or layout than the tensor it was to write: it runs in place
        session.repoint(key, result.untyped_storage())
        return target

    @staticmethod
    def _own_written(session: Session, operator: Any, args: list[Any], kwargs: dict[str, Any]) -> None:
        """Give the session its own copy of each shared storage the operator is about to write."""
        for tensor in written_tensors(operator, args, kwargs):
            session.before_write(tensor)

    def _as_out_of_memory(self, session: Session, error: RuntimeError) -> RuntimeError:
        """CUDA's out-of-memory error for a failure of the host allocator (virtual device), else `error`."""
        found = _HOST_ALLOCATION_FAILED.search(str(error))
        return self.memory.out_of_memory(session, int(found.group(1))) if found else error

    def _check_planned(self, session: Session, served: Any, args: list[Any], kwargs: dict[str, Any]) -> None:
        """Refuse, before it allocates, an operator whose `size` argument asks for more than is free."""
        position = served.size_argument
        size = args[position] if position < len(args) else kwargs.get("size")
        if type(size) is not list or not all(type(n) is int for n in size):
            return
        if math.prod(size) * 16 <= self.memory.free_bytes():  # 16: the widest element
            return
        try:
            planned = meta_growth(served.operator, args, kwargs)
        except Exception:  # no meta kernel: the check after running it will do
            return
        session.check_room(planned)

    def _allocate(self, session: Session, handle: Any, dtype: Any, shape: Any, stride: Any) -> torch.Tensor:
        """A new uninitialised tensor under a fresh handle, refused before allocating if it does not fit."""
        session.claim_handle(handle)
        found = _NAMES.dtype(dtype)
        sizes, steps = protocol.integers(shape), protocol.integers(stride)
        if len(sizes) != len(steps):
            raise ProtocolError(f"shape {sizes} and stride {steps} differ in length")
        nbytes = protocol.storage_extent(sizes, steps) * found.itemsize
        session.check_room(nbytes)
        tensor = torch.empty_strided(sizes, steps, dtype=found, device=self.device)
        session.add(handle, tensor)
        return tensor

    def _run(self, session: Session, op: Any, buffers: Sequence[Any]) -> None:
        """Carry out one operation of a batch."""
        if type(op) is not list or not op:
            raise ProtocolError(f"malformed operation {str(op)[:100]}")
        kind = op[0]
        if session.swapped and kind not in _NOT_READING:
            session.swap_in_all()
        if kind == protocol.OP_RUN:
            self._run_plan(session, op, buffers, answer=False)
        elif kind == protocol.OP_CALL:
            self._call(session, op, buffers)
        elif kind == protocol.OP_PLAN:
            _, plan_id, op_id, args, kwargs = _operation(op, 5)
            session.plan(plan_id, op_id, args, kwargs, self.device)
        elif kind == protocol.OP_FREE:
            for handle in protocol.integers(_operation(op, 2)[1], most=1 << 20):
                session.free(handle)
        elif kind == protocol.OP_DEFINE:
            _, op_id, namespace, name, overload = _operation(op, 5)
            session.define(protocol.integer(op_id), namespace, name, overload)
        elif kind == protocol.OP_UPLOAD:
            _, handle, dtype, shape, stride, index = _operation(op, 6)
            data = protocol.buffer_at(buffers, index)
            found, sizes, steps = protocol.check_layout(dtype, shape, stride, data.nbytes)
            if protocol.storage_extent(sizes, steps) * found.itemsize != data.nbytes:
                raise ProtocolError(f"{data.nbytes} bytes are not the storage of a {sizes} {dtype} tensor")
            self._write(self._allocate(session, handle, dtype, shape, stride), 0, data)
        elif kind == protocol.OP_ALLOCATE:
            _, handle, dtype, shape, stride = _operation(op, 5)
            self._allocate(session, handle, dtype, shape, stride)
        elif kind == protocol.OP_WRITE:
            _, handle, offset, index = _operation(op, 4)
            target = session.tensor(handle)
            session.before_write(target)
            self._forget_value(target)
            self._write(target, protocol.integer(offset), protocol.buffer_at(buffers, index))
        elif kind == protocol.OP_FILL:
            _, handle, dtype, shape, stride, index = _operation(op, 6)
            values = protocol.tensor_from_raw(dtype, shape, stride, protocol.buffer_at(buffers, index))
            target = session.tensor(handle)
            if session.shrunk_storages:
                check_within_storages([target])
            session.before_write(target)
            self._forget_value(target)
            target.copy_(values)
        elif kind == protocol.OP_RESIZE_STORAGE:
            _, handle, nbytes = _operation(op, 3)
            session.before_write(session.tensor(handle))
            self._forget_value(session.tensor(handle))
            storage = session.tensor(handle).untyped_storage()
            session.check_room(max(0, protocol.integer(nbytes) - storage.nbytes()))
            session.shrunk_storages |= protocol.integer(nbytes) < storage.nbytes()
            storage.resize_(nbytes)
            session.recount(handle)
        elif kind == protocol.OP_SETTINGS:
            settings = _operation(op, 2)[1]
            numerics.apply(settings)
            session.settings = None if settings == _SERVER_SETTINGS else settings
        elif kind == protocol.OP_FACTORY:
            _, handle, name, args, kwargs = _operation(op, 5)
            if name not in _FACTORIES:
                raise RuntimeError(f"proxy: factory {name!r} not allowed")
            session.claim_handle(handle)
            decoded_args, decoded_kwargs = self._decode_all(session, args, kwargs, [], buffers)
            meta_kwargs = {**decoded_kwargs, "device": "meta"}
            planned = getattr(torch, name)(*decoded_args, **meta_kwargs)
            session.check_room(planned.numel() * planned.element_size())
            tensor = getattr(torch, name)(*decoded_args, **decoded_kwargs)
            session.add(handle, tensor)
        else:
            raise ProtocolError(f"unknown operation {kind!r}")

    def _forget_value(self, tensor: torch.Tensor) -> None:
        """A tensor is about to be written outside any operator: its storage's value id is void."""
        if self.memory.values:
            self.memory.values.pop(tensor.untyped_storage()._cdata, None)

    def _write(self, tensor: torch.Tensor, offset: int, data: Any) -> None:
        """Copy bytes into a tensor's storage at a byte offset, within the storage."""
        source = memoryview(data).cast("B")
        storage = tensor.untyped_storage()
        if offset + source.nbytes > storage.nbytes():
            raise ProtocolError(f"{source.nbytes} bytes at offset {offset} do not fit in {storage.nbytes()}")
        if source.nbytes == 0:
            return
        target = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
        target[offset : offset + source.nbytes].copy_(torch.frombuffer(source, dtype=torch.uint8))
        if not tensor.is_inference():  # a pre-copy must see this write (snapshot.py)
            torch.autograd.graph.increment_version(tensor)

    def _figure(self, session: Session, what: str) -> Any:
        """Answer a query for a figure of the session's memory or of the device."""
        if what == protocol.UTILIZATION:
            return self.busy.utilization_percent(time.perf_counter())
        if what == protocol.MEMORY_ALLOCATED:
            return session.held_bytes
        if what == protocol.MEMORY_PEAK:
            return session.peak_bytes
        if what == protocol.MEMORY_RESET_PEAK:
            session.peak_bytes = session.held_bytes
            return None
        if what == protocol.MEMORY_INFO:
            return (self.memory.free_bytes(), self.memory.capacity)
        if what == protocol.MEMORY_STATS:
            return {
                "allocated_bytes.all.current": session.held_bytes,
                "allocated_bytes.all.peak": session.peak_bytes,
                "reserved_bytes.all.current": session.held_bytes,
                "reserved_bytes.all.peak": session.peak_bytes,
                "active_bytes.all.current": session.held_bytes,
                "num_ooms": 0,
            }
        raise ProtocolError(f"unknown figure {what!r}")

    def _answer(self, session: Session, request: Any, buffers: Sequence[Any]) -> Any:
        """The value a request asks for."""
        if type(request) is not list or not request:
            raise ProtocolError(f"malformed request {str(request)[:100]}")
        kind = request[0]
        if kind == protocol.REQ_RUN:
            return self._run_plan(session, request, buffers, answer=True)
        if kind == protocol.REQ_CALL:
            return self._call(session, request, buffers)
        if kind == protocol.REQ_FETCH:
            tensor = session.tensor(_operation(request, 2)[1])
            if session.swapped:
                session.swap_in_tensors([tensor])
            if session.shrunk_storages:
                check_within_storages([tensor])
            if tensor.layout == torch.strided:
                return raw_values(tensor)
            return {
                "layout": str(tensor.layout).removeprefix("torch."),
                "shape": list(tensor.shape),
                "coalesced": tensor.layout == torch.sparse_coo and tensor.is_coalesced(),
                "parts": [raw_values(part) for part in sparse_parts(tensor)],
            }
        if kind == protocol.REQ_SYNC:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return None
        if kind == protocol.REQ_FIGURE:
            return self._figure(session, _operation(request, 2)[1])
        raise ProtocolError(f"unknown request {kind!r}")

    def run_ops(
        self, session: Session, ops: list[Any], start: int, end: int, buffers: Sequence[Any],
        pauses: Callable[[int], bool] | None = None,
    ) -> int:  # fmt: skip
        """Run operations start..end-1 of a frame in order, holding the device; failures are kept.
        Where an operation made what other ranks here will be squashed onto and `pauses(operations
        run)` says so, stop there (pace.py). Where it stopped.

        The first failure is remembered in the session and reported at its next request.
        """
        with self.lock:
            self.busy.begin(time.perf_counter())
            position = start
            _use_settings(session)
            try:
                while position < end:
                    try:
                        self._run(session, ops[position], buffers)
                    except Exception as e:
                        session.fail(e)
                    position += 1
                    if session.led:
                        session.led = False
                        if pauses is not None and position < end and pauses(position - start):
                            break
            finally:
                self.operations += position - start
                _restore_settings(session)
                self.busy.end(time.perf_counter())
            return position

    def answer(self, session: Session, request: Any, buffers: Sequence[Any]) -> Any:
        """The answer to a request, after raising what failed first since the last answer."""
        with self.lock:
            self.busy.begin(time.perf_counter())
            _use_settings(session)
            try:
                session.raise_pending()
                return self._answer(session, request, buffers)
            finally:
                _restore_settings(session)
                self.busy.end(time.perf_counter())
