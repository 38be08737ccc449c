# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""torch's deterministic-mode branches for CUDA tensors, taken for stand-ins as the CPU takes them.

Under `torch.use_deterministic_algorithms(True)` (Lightning's `deterministic=True`, Hugging Face's
`enable_full_determinism`), `F.pad(mode="replicate")`, `F.interpolate` (bilinear, trilinear) and
`F.max_pool3d(return_indices=True)` hand a CUDA tensor to a Python decomposition whose backward
avoids CUDA's atomic adds; the CPU runs its kernels, which are deterministic. A proxied device's
kernels are the server's CPU kernels, so for stand-ins those decompositions give way to the kernels
a direct CPU run uses, with its bits: the decompositions differed in the low bits, and the two
that make index tensors with `device=input.device` failed (they ran outside the device mode).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from .on_import import patch_modules
from .tensor import ProxyTensor

_nn = torch._C._nn


def _replication_pad(original: Any) -> Any:
    def replication_pad(input: Any, padding: Any) -> Any:
        if isinstance(input, ProxyTensor):
            return _nn.pad(input, padding, "replicate", None)
        return original(input, padding)

    return replication_pad


def _upsample_linear_vec(original: Any) -> Any:
    def upsample_linear_vec(input: Any, output_size: Any, align_corners: Any, scale_factors: Any) -> Any:
        if isinstance(input, ProxyTensor):
            kernel = _nn.upsample_bilinear2d if input.dim() == 4 else _nn.upsample_trilinear3d
            return kernel(input, output_size, align_corners, scale_factors)
        return original(input, output_size, align_corners, scale_factors)

    return upsample_linear_vec


def _max_pool3d_with_indices(original: Any) -> Any:
    def max_pool3d_with_indices(input: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(input, ProxyTensor):
            return _nn.max_pool3d_with_indices(input, *args, **kwargs)
        return original(input, *args, **kwargs)

    return max_pool3d_with_indices


_TAKEN_AS_ON_THE_CPU = {
    "_replication_pad": _replication_pad,
    "_upsample_linear_vec": _upsample_linear_vec,
    "max_pool3d_with_indices": _max_pool3d_with_indices,
}
"""The decompositions `torch.nn.functional` calls for CUDA tensors in deterministic mode, by name
(it looks them up in torch._decomp.decompositions at each call)."""


def _patch(decompositions: ModuleType) -> None:
    for name, wrap in _TAKEN_AS_ON_THE_CPU.items():
        setattr(decompositions, name, wrap(getattr(decompositions, name)))


def install() -> None:
    """Send stand-ins past those decompositions, once torch._decomp.decompositions is imported."""
    patch_modules({"torch._decomp.decompositions": _patch})
