"""Operators of libraries the server does not serve, run in the job by their own CPU kernel.

C++ extensions (torchvision's `nms`, `roi_align`, `deform_conv2d`) register a schema and a kernel
per device type; the server runs only torch's own operators (aten, prims), for a job may load any
library. On a device such an operator runs here, as the CPU runs it: on host copies of its inputs,
its outputs uploaded to the device of its first device input and the inputs it writes updated.
Its autograd formula, if it has one, runs above this, as for any operator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from . import protocol
from .tensor import ProxyTensor, SpecialHandler, download, fill, upload_to

_LEFT_TO_THE_SERVER = frozenset({"c10d"})
"""Namespaces whose unserved operators keep the server's refusal (it says why)."""


def host_kernel_handler(func: Any) -> SpecialHandler | None:
    """The handler running `func` by its CPU kernel on host copies, for an operator of a namespace
    the server does not serve that has one; None for any other operator."""
    namespace = func.namespace
    if namespace in protocol.SERVED_NAMESPACES or namespace in _LEFT_TO_THE_SERVER:
        return None
    if not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CPU"):
        return None
    arguments = func._schema.arguments
    written = [
        (position, argument.name)
        for position, argument in enumerate(arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    ]

    def run(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        leaves = pytree.tree_leaves((args, kwargs))
        channel = next(leaf for leaf in leaves if isinstance(leaf, ProxyTensor))._channel
        stand_in_of: dict[int, ProxyTensor] = {}

        def to_host(value: Any) -> Any:
            if not isinstance(value, ProxyTensor):
                return value
            host = download(value.detach())
            stand_in_of[id(host)] = value
            return host

        host_args, host_kwargs = pytree.tree_map(to_host, (list(args), dict(kwargs)))
        outputs = func(*host_args, **host_kwargs)
        for position, name in written:
            host = host_args[position] if position < len(host_args) else host_kwargs.get(name)
            stand_in = stand_in_of.get(id(host))
            if stand_in is not None:
                fill(stand_in, host)

        def to_device(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            stand_in = stand_in_of.get(id(value))
            return upload_to(channel, value) if stand_in is None else stand_in

        return pytree.tree_map(to_device, outputs)

    return run
