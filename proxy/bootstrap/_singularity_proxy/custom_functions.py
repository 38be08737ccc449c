"""Custom autograd Functions whose outputs are on proxied devices: gradients of unused outputs.

When an output of a `torch.autograd.Function` gets no gradient, the engine gives its backward
zeros made with the output's C++ options, which for a stand-in name the host; `g1 * 2 + g2 * 3`
then mixes devices where a GPU gives zeros on the output's device. The devices of a Function's
outputs are noted when it runs, and such host zeros become zeros on the device before its
backward sees them.
"""

from __future__ import annotations

from typing import Any

import torch

from .channel import CLIENT_LOCK
from .tensor import ProxyTensor
from .transfers import upload

_FUNCTION_APPLY = torch.autograd.Function.apply.__func__  # type: ignore[attr-defined]
_BACKWARD_APPLY: Any = torch.autograd.function.BackwardCFunction.apply


def _apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
    """`Function.apply`, noting on the backward node the device of each output on a proxied one."""
    outputs = _FUNCTION_APPLY(cls, *args, **kwargs)
    flat = outputs if isinstance(outputs, tuple) else (outputs,)
    nodes = (out.grad_fn for out in flat if type(out) is ProxyTensor and out.grad_fn is not None)
    node: Any = next(nodes, None)
    if node is not None:
        node._proxied_outputs = tuple(
            out._channel.index if type(out) is ProxyTensor else None for out in flat
        )
    return outputs


def _backward_apply(self: Any, *grads: Any) -> Any:
    """The node's backward, given its device outputs' materialised zeros on their devices."""
    devices = getattr(self, "_proxied_outputs", None)
    if devices is not None and len(devices) == len(grads):
        grads = tuple(
            _zeros_on(index, grad) if index is not None and type(grad) is torch.Tensor else grad
            for grad, index in zip(grads, devices, strict=True)
        )
    return _BACKWARD_APPLY(self, *grads)


def _zeros_on(index: int, host: torch.Tensor) -> ProxyTensor:
    with CLIENT_LOCK:
        return upload(torch.zeros(host.shape, dtype=host.dtype), index)


def install() -> None:
    """Give custom Functions' backward the unused outputs' zeros on their devices."""
    torch.autograd.Function.apply = classmethod(_apply)  # type: ignore[method-assign,assignment]
    torch.autograd.function.BackwardCFunction.apply = _backward_apply  # type: ignore[method-assign]
