# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""Composite operators that torch's C++ decomposes another way for tensor subclasses, run whole.

A few composites choose their decomposition by whether the input "may need gradients", and
count any tensor subclass as such: `linalg_svdvals` computes the singular vectors too,
`linalg_eigvalsh` the eigenvectors, which changes the LAPACK routine and so the bits of the
result. For a stand-in, which is a subclass, the program would get other values than on the
CPU or a GPU. When no gradient is needed these operators are sent to the server whole (the
server's tensors are plain ones, so it decomposes them as the CPU does); otherwise, and for
every tensor that is not a stand-in, torch's own decomposition runs, as before.
"""

from __future__ import annotations

from typing import Any

import torch

from .tensor import ProxyTensor, forward

aten = torch.ops.aten

WHOLE_WITHOUT_GRADIENTS = (
    aten.linalg_svdvals.default,
    aten.linalg_eigvalsh.default,
    aten.linalg_eigvals.default,
)
"""Composites whose decomposition depends on whether the input is a tensor subclass."""

_library: list[Any] = []


def _kernel(op: Any) -> Any:
    """The autograd kernel of `op`: whole on the server for stand-ins that need no gradient."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else None
        if type(first) is ProxyTensor and not (torch.is_grad_enabled() and first.requires_grad):
            return forward(op, args, kwargs or None)
        return op.decompose(*args, **kwargs)

    return kernel


def install() -> None:
    """Register the kernels (for tensors whose C++ device is the host, as stand-ins' is)."""
    if _library:
        return
    library = torch.library.Library("aten", "IMPL")
    for op in WHOLE_WITHOUT_GRADIENTS:
        library.impl(
            op._name.removeprefix("aten::")
            + ("" if op._overloadname == "default" else f".{op._overloadname}"),
            _kernel(op),
            "AutogradCPU",
        )
    _library.append(library)
