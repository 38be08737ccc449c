"""Kernels that torch has for CUDA only, written for host tensors, so a virtual device runs them.

A virtual device's tensors are host tensors, and a CPU build of torch lacks a few operators that
programs reach only on a GPU. `nn.SyncBatchNorm` (what `convert_sync_batchnorm` gives a DDP
model) is the common one: it computes its statistics and gradients with five `batch_norm_*`
operators, which exist only for CUDA. They are written here with other operators, following the
CUDA kernels' arithmetic (each rank's statistics merged in rank order, reduced precision computed
in float32), and registered for the CPU dispatch key when the installed torch has no CPU kernel
for them. A server on a real GPU runs CUDA's own; host tensors are all these ever see.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_REDUCED = (torch.float16, torch.bfloat16)
_library: list[Any] = []


def _accumulating(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor in the type CUDA's kernels accumulate it in (float32 for half and bfloat16)."""
    return tensor.float() if tensor.dtype in _REDUCED else tensor


def _per_channel(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-channel vector shaped to broadcast over `like` (channels are dimension 1)."""
    return tensor.reshape([1, -1] + [1] * (like.dim() - 2))


def _reduced_dims(tensor: torch.Tensor) -> list[int]:
    """Every dimension but the channels."""
    return [0, *range(2, tensor.dim())]


def batch_norm_stats(input: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and inverse standard deviation (biased variance) of this rank's input."""
    values = _accumulating(input)
    dims = _reduced_dims(values)
    mean = values.mean(dims)
    variance = values.var(dims, correction=0)
    return mean, (variance + eps).rsqrt()


def batch_norm_gather_stats_with_counts(
    input: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor, running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None, momentum: float, eps: float, counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Every rank's statistics merged in rank order (as CUDA's kernel merges them); the running
    statistics updated in place, the variance unbiased."""
    weights = counts.to(mean.dtype)
    average = torch.zeros_like(mean[0])
    squares = torch.zeros_like(mean[0])
    total = torch.zeros((), dtype=mean.dtype)
    for rank in range(mean.shape[0]):
        count = weights[rank]
        rank_mean = mean[rank]
        rank_var = (invstd[rank].reciprocal().square() - eps) * count
        factor = (total + count).reciprocal()
        squares = squares + rank_var + (average - rank_mean).square() * total * count * factor
        average = total * factor * average + count * factor * rank_mean
        total = total + count
    with torch.no_grad():
        if running_mean is not None:
            running_mean.copy_((1 - momentum) * running_mean + momentum * average.to(running_mean.dtype))
        if running_var is not None:
            unbiased = squares / (total - 1)
            running_var.copy_((1 - momentum) * running_var + momentum * unbiased.to(running_var.dtype))
    return average, (squares / total + eps).rsqrt()


def batch_norm_gather_stats(
    input: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor, running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None, momentum: float, eps: float, count: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`batch_norm_gather_stats_with_counts` with one count for every rank."""
    counts = torch.full((mean.shape[0],), count, dtype=mean.dtype)
    stats = (running_mean, running_var)
    return batch_norm_gather_stats_with_counts(input, mean, invstd, *stats, momentum, eps, counts)


def batch_norm_elemt(
    input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, mean: torch.Tensor,
    invstd: torch.Tensor, eps: float,
) -> torch.Tensor:  # fmt: skip
    """The normalised input: weight * (input - mean) * invstd + bias, per channel."""
    values = _accumulating(input)
    output = (values - _per_channel(mean, values)) * _per_channel(invstd, values)
    if weight is not None:
        output = _per_channel(_accumulating(weight), values) * output
    if bias is not None:
        output = output + _per_channel(_accumulating(bias), values)
    return output.to(input.dtype).contiguous(memory_format=_memory_format(input))


def batch_norm_backward_reduce(
    grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
    weight: torch.Tensor | None, input_g: bool, weight_g: bool, bias_g: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """This rank's per-channel sums of the gradient and of the gradient times (input - mean), and
    the weight's and bias's gradients from them (all four always computed)."""
    grads, values = _accumulating(grad_out), _accumulating(input)
    dims = _reduced_dims(values)
    sum_dy = grads.sum(dims).to(mean.dtype)
    sum_dy_xmu = (grads * (values - _per_channel(mean, values))).sum(dims).to(mean.dtype)
    parameter_dtype = weight.dtype if weight is not None else mean.dtype
    return sum_dy, sum_dy_xmu, (sum_dy_xmu * invstd).to(parameter_dtype), sum_dy.to(parameter_dtype)


def batch_norm_backward_elemt(
    grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
    weight: torch.Tensor | None, sum_dy: torch.Tensor, sum_dy_xmu: torch.Tensor, count: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The input's gradient from the sums every rank contributed (`count`: each rank's elements)."""
    grads, values = _accumulating(grad_out), _accumulating(input)
    norm = count.to(mean.dtype).sum().reciprocal()
    mean_dy = sum_dy * norm
    mean_dy_xmu = sum_dy_xmu * norm
    scale = invstd if weight is None else _accumulating(weight) * invstd
    factor = invstd * invstd * mean_dy_xmu
    centred = values - _per_channel(mean, values)
    shifted = grads - _per_channel(mean_dy, values) - centred * _per_channel(factor, values)
    grad_input = shifted * _per_channel(scale, values)
    return grad_input.to(input.dtype).contiguous(memory_format=_memory_format(input))


def _memory_format(tensor: torch.Tensor) -> torch.memory_format:
    """Channels-last where the input is, as CUDA's kernels keep it."""
    if tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if tensor.dim() == 5 and tensor.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


KERNELS: dict[str, Callable[..., Any]] = {
    "batch_norm_stats": batch_norm_stats,
    "batch_norm_gather_stats_with_counts": batch_norm_gather_stats_with_counts,
    "batch_norm_gather_stats": batch_norm_gather_stats,
    "batch_norm_elemt": batch_norm_elemt,
    "batch_norm_backward_reduce": batch_norm_backward_reduce,
    "batch_norm_backward_elemt": batch_norm_backward_elemt,
}
"""aten operator -> its host kernel."""


def install() -> list[str]:
    """Register the host kernels torch lacks for the CPU dispatch key (once); their names."""
    if _library:
        return []
    library = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
    installed = []
    for name, kernel in KERNELS.items():
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CPU"):
            library.impl(name, kernel, "CPU")  # type: ignore[no-untyped-call]
            installed.append(name)
    _library.append(library)
    return installed
