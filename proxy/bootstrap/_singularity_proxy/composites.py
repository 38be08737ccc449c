# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""Composite operators that torch's C++ decomposes another way for tensor subclasses, run whole.

A few composites choose their decomposition by whether the input "may need gradients", and
count any tensor subclass as such: `linalg_svdvals` computes the singular vectors too,
`linalg_eigvalsh` the eigenvectors, which changes the LAPACK routine and so the bits of the
result. For a stand-in, which is a subclass, the program would get other values than on the
CPU or a GPU. When no gradient is needed these operators are sent to the server whole (the
server's tensors are plain ones, so it decomposes them as the CPU does); otherwise, and for
every tensor that is not a stand-in, torch's own decomposition runs, as before.

`cross_entropy_loss` with class weights, label smoothing and the mean reduction divides by the
weights of the targets it does not ignore, which it sums over another set of elements when the
weight is a subclass (all targets, the ignored ones' weights zeroed): the loss's gradient then
differed in the low bits. For a stand-in weight it runs here as torch's C++ runs it for a plain
one, operation for operation, so autograd records the same graph.

`scaled_dot_product_attention` chooses its kernel among the host's (flash, math) for stand-ins.
A program that allows only GPU kernels (`sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)`, or flash
and math switched off, leaving memory-efficient attention on) found "No viable backend" where a GPU
runs it; there the host's default choice runs instead, as it would with every backend allowed.

`histc` of integers, which CUDA counts and the host's kernel refuses (transformers' mixtures of
experts count tokens per expert so on any device but the CPU), counts the values as float64
and gives the counts in the input's dtype, as CUDA does: float64 holds every integer that fits
in a bin's arithmetic exactly, so the bins are CUDA's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import tensor
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


_CROSS_ENTROPY = aten.cross_entropy_loss.default
_MEAN = 1  # torch's Reduction::Mean


def _cross_entropy(
    input: Any, target: Any, weight: Any = None, reduction: int = _MEAN, ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> Any:  # fmt: skip
    """`cross_entropy_loss`: the label-smoothed mean over class weights as for a plain weight
    (LossNLL.cpp's `cross_entropy_loss_label_smoothing`) when the weight is a stand-in."""
    if (
        type(weight) is not ProxyTensor
        or label_smoothing <= 0.0
        or reduction != _MEAN
        or input.shape == target.shape
        or label_smoothing > 1.0
    ):
        return _CROSS_ENTROPY.decompose(input, target, weight, reduction, ignore_index, label_smoothing)
    class_dim = 0 if input.dim() == 1 else 1
    log_probabilities = torch.log_softmax(input, class_dim, dtype=input.dtype)
    nll = torch._C._nn.nll_loss_nd(log_probabilities, target, weight, reduction, ignore_index)  # type: ignore[arg-type]
    classes = log_probabilities.size(class_dim)
    shape = [1] * log_probabilities.dim()
    shape[class_dim] = weight.size(0)
    smooth = -(log_probabilities * weight.view(shape)).sum(class_dim)
    ignored = target == ignore_index
    smooth.masked_fill_(ignored, 0.0)
    kept_weights = weight.gather(0, target.masked_select(~ignored).flatten())
    smoothed = smooth.sum() / kept_weights.sum()
    return nll * (1 - label_smoothing) + smoothed * (label_smoothing / classes)


_ATTENTION = aten.scaled_dot_product_attention.default


def _attention(*args: Any, **kwargs: Any) -> Any:
    """`scaled_dot_product_attention` by the host's default kernel for stand-ins when the program
    allows only backends a GPU has and the host lacks (memory-efficient, cuDNN)."""
    if (
        type(args[0]) is not ProxyTensor
        or torch._C._get_flash_sdp_enabled()
        or torch._C._get_math_sdp_enabled()
        or not (torch._C._get_mem_efficient_sdp_enabled() or torch._C._get_cudnn_sdp_enabled())
    ):
        return _ATTENTION.decompose(*args, **kwargs)
    try:
        torch._C._set_sdp_use_flash(True)
        torch._C._set_sdp_use_math(True)
        return _ATTENTION.decompose(*args, **kwargs)
    finally:
        torch._C._set_sdp_use_flash(False)
        torch._C._set_sdp_use_math(False)


def _histc(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`histc` of a stand-in: counted in float64 for integers (as CUDA counts them), else as is."""
    values = args[0]
    if values.dtype.is_floating_point or values.dtype.is_complex:
        return forward(func, args, kwargs)
    counts = forward(func, (values.to(torch.float64), *args[1:]), kwargs)
    return counts.to(values.dtype)


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
    library.impl("cross_entropy_loss", _cross_entropy, "AutogradCPU")
    library.impl("scaled_dot_product_attention", _attention, "AutogradCPU")
    _library.append(library)
    tensor.special_ops[aten.histc.default] = _histc
