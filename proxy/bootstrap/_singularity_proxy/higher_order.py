# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""Higher-order operators (`flex_attention`, `torch.cond`, `while_loop`, `map`,
`associative_scan`) on stand-ins, by their dense implementation.

torch dispatches a higher-order operator on a tensor subclass only by a rule registered for that
subclass, and stand-ins had none: "There was no rule registered for HOP flex_attention and subclass
ProxyTensor" (transformers' `attn_implementation="flex_attention"`, control flow written with
`torch.cond`). The rule runs the operator's dense implementation, the one the CPU runs eagerly,
whose operators reach the device as any others do; it runs under the device mode (torch leaves
function modes while it dispatches), so that the tensors it makes on "cuda" are made on the device.
A rule is registered the first time an operator is dispatched on stand-ins, since most are created
when their module is first imported.
"""

from __future__ import annotations

from typing import Any

from torch._C import DispatchKey
from torch._ops import HigherOrderOperator

from .tensor import ProxyTensor, under_device_mode

_DENSE = DispatchKey.CompositeExplicitAutograd


def _register(operator: HigherOrderOperator) -> None:
    """Give the operator a rule for stand-ins: its dense kernel, if it has one."""
    kernel = operator.py_kernels.get(_DENSE)
    if kernel is None or ProxyTensor in operator.python_key_table:
        return

    def rule(*args: Any, **kwargs: Any) -> Any:
        return under_device_mode(kernel, *args, **kwargs)

    operator.py_impl(ProxyTensor)(rule)


def install() -> None:
    """Register rules for stand-ins when a higher-order operator is dispatched on the Python key."""
    original = HigherOrderOperator.dispatch

    def dispatch(self: HigherOrderOperator, /, dispatch_key: Any, *args: Any, **kwargs: Any) -> Any:
        if dispatch_key == DispatchKey.Python and ProxyTensor not in self.python_key_table:
            _register(self)
        return original(self, dispatch_key, *args, **kwargs)

    HigherOrderOperator.dispatch = dispatch  # type: ignore[method-assign]
