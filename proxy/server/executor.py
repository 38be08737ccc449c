"""Runs a session's operations and answers its requests, one batch at a time, in order.

Operations in a batch are not answered: the first failure is kept in the session and
reported at its next request, the way CUDA reports asynchronous errors at the next sync.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from singularity.proxy.bootstrap._singularity_proxy import protocol

from .session import DeviceMemory, Session

_FACTORIES = frozenset(protocol.SERVER_FACTORIES)


def exception_info(error: BaseException) -> tuple[str, str, str]:
    """(module, qualified name, message) of an exception, as sent in an ERROR message."""
    kind = type(error)
    message = str(error)
    if isinstance(error, KeyError):  # str() of a KeyError quotes its key
        message = str(error.args[0]) if error.args else ""
    return (kind.__module__, kind.__qualname__, message)


def resolve_operator(namespace: str, name: str, overload: str) -> Any:
    """The torch operator (OpOverload) called namespace::name.overload."""
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def template_new_bytes(template: Any) -> list[int]:
    """Bytes of new storage of each new tensor in an output template."""
    if template[0] == protocol.TEMPLATE_TENSOR:
        return [template[2]]
    if template[0] in (protocol.TEMPLATE_LIST, protocol.TEMPLATE_TUPLE):
        return [nbytes for item in template[1] for nbytes in template_new_bytes(item)]
    return []


class Executor:
    """Runs operations for the sessions of one device, one at a time."""

    def __init__(self, device: torch.device, memory: DeviceMemory) -> None:
        self.device = device
        self.memory = memory
        self.lock = threading.Lock()
        """Held while anything runs on the device (operations, saves, loads)."""

    # -- arguments and outputs ------------------------------------------------------------------
    def _decode(self, session: Session, arg: Any, inputs: list[torch.Tensor]) -> Any:
        """An argument as the operator takes it: handles become tensors, the marker the device."""
        kind = type(arg)
        if kind is slice:
            tensor = session.tensors[arg.stop]
            inputs.append(tensor)
            return tensor
        if kind is list:
            return [self._decode(session, item, inputs) for item in arg]
        if kind is tuple:
            return protocol.tensor_from_raw(arg[1], arg[2], arg[3], arg[4]).to(self.device)
        if kind is str and arg == protocol.DEVICE_MARKER:
            return self.device
        return arg

    def _template(
        self,
        session: Session,
        output: Any,
        inputs: list[torch.Tensor],
        next_handle: list[int],
        new_handles: list[int],
    ) -> Any:
        """The output template of `output`, holding its new tensors under the next handles."""
        if isinstance(output, torch.Tensor):
            for position, tensor in enumerate(inputs):
                if output is tensor:
                    return (protocol.TEMPLATE_ALIAS, position)
            handle = next_handle[0]
            next_handle[0] = handle + 1
            nbytes = session.add(handle, output)
            new_handles.append(handle)
            meta = (tuple(output.shape), tuple(output.stride()), output.storage_offset(), output.dtype)
            return (protocol.TEMPLATE_TENSOR, meta, nbytes)
        if isinstance(output, list):
            items = [self._template(session, o, inputs, next_handle, new_handles) for o in output]
            return (protocol.TEMPLATE_LIST, items)
        if isinstance(output, tuple):
            items = [self._template(session, o, inputs, next_handle, new_handles) for o in output]
            return (protocol.TEMPLATE_TUPLE, items)
        if output is None:
            return (protocol.TEMPLATE_NONE,)
        if isinstance(output, (bool, int, float, complex, str)):
            return (protocol.TEMPLATE_VALUE, output)
        return (protocol.TEMPLATE_VALUE, repr(output))

    # -- operations -------------------------------------------------------------------------------
    def _call(self, session: Session, op_id: int, first_handle: int, args: Any, kwargs: Any) -> Any:
        """Run a defined operator; its output template."""
        operator = session.operators[op_id]
        inputs: list[torch.Tensor] = []
        decoded_args = [self._decode(session, arg, inputs) for arg in args]
        decoded_kwargs = {k: self._decode(session, v, inputs) for k, v in kwargs.items()} if kwargs else {}
        output = operator(*decoded_args, **decoded_kwargs)
        new_handles: list[int] = []
        template = self._template(session, output, inputs, [first_handle], new_handles)
        if new_handles:
            session.check_capacity(new_handles, sum(template_new_bytes(template)))
        return template

    def _hold_new(self, session: Session, handle: int, tensor: torch.Tensor) -> None:
        """Hold a tensor made for the session, within the device's capacity."""
        nbytes = session.add(handle, tensor)
        session.check_capacity([handle], nbytes)

    def _run(self, session: Session, op: tuple[Any, ...]) -> None:
        """Carry out one operation of a batch."""
        kind = op[0]
        if kind == protocol.OP_CALL:
            self._call(session, op[1], op[2], op[3], op[4])
        elif kind == protocol.OP_FREE:
            for handle in op[1]:
                session.free(handle)
        elif kind == protocol.OP_DEFINE:
            session.operator_names[op[1]] = op[2]
            session.operators[op[1]] = resolve_operator(*op[2])
        elif kind == protocol.OP_UPLOAD:
            tensor = protocol.tensor_from_raw(op[2], op[3], op[4], op[5])
            if self.device.type != "cpu":
                tensor = tensor.to(self.device)
            self._hold_new(session, op[1], tensor)
        elif kind == protocol.OP_FILL:
            session.tensors[op[1]].copy_(protocol.tensor_from_raw(op[2], op[3], op[4], op[5]))
        elif kind == protocol.OP_FACTORY:
            name = op[2]
            if name not in _FACTORIES:
                raise RuntimeError(f"proxy: factory {name!r} not allowed")
            options = {k: (self.device if v == protocol.DEVICE_MARKER else v) for k, v in op[4].items()}
            self._hold_new(session, op[1], getattr(torch, name)(*op[3], **options))
        else:
            raise RuntimeError(f"proxy: unknown operation {kind!r}")

    def _memory(self, session: Session, what: str) -> Any:
        """Answer a memory query."""
        if what == protocol.MEMORY_ALLOCATED:
            return session.held_bytes
        if what == protocol.MEMORY_PEAK:
            return session.peak_bytes
        if what == protocol.MEMORY_RESET_PEAK:
            session.peak_bytes = session.held_bytes
            return None
        if what == protocol.MEMORY_INFO:
            return (self.memory.free_bytes(), self.memory.capacity)
        return {
            "allocated_bytes.all.current": session.held_bytes,
            "allocated_bytes.all.peak": session.peak_bytes,
            "reserved_bytes.all.current": session.held_bytes,
            "reserved_bytes.all.peak": session.peak_bytes,
            "active_bytes.all.current": session.held_bytes,
            "num_ooms": 0,
        }

    def _answer(self, session: Session, request: tuple[Any, ...]) -> Any:
        """The value a request asks for."""
        kind = request[0]
        if kind == protocol.REQ_CALL:
            return self._call(session, request[1], request[2], request[3], request[4])
        if kind == protocol.REQ_FETCH:
            host, raw = protocol.tensor_to_raw(session.tensors[request[1]])
            return (host.dtype, tuple(host.shape), tuple(host.stride()), raw)
        if kind == protocol.REQ_SYNC:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return None
        if kind == protocol.REQ_MEMORY:
            return self._memory(session, request[1])
        raise RuntimeError(f"proxy: unknown request {kind!r}")

    def run_batch(self, session: Session, ops: list[Any], request: Any) -> Any:
        """Run a batch in order; the REPLY or ERROR message for its request (None without one)."""
        with self.lock:
            for op in ops:
                try:
                    self._run(session, op)
                except Exception as e:
                    if session.pending_error is None:
                        session.pending_error = exception_info(e)
            if request is None:
                return None
            if session.pending_error is not None:
                error, session.pending_error = session.pending_error, None
                return (protocol.ERROR, *error)
            try:
                return (protocol.REPLY, self._answer(session, request))
            except Exception as e:
                return (protocol.ERROR, *exception_info(e))
