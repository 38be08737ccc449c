# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""torch's Python branches for CUDA tensors, taken for stand-ins as the CPU takes them.

A proxied device's kernels are the server's CPU kernels, so where torch's Python picks another
path for a CUDA tensor than for a host one, a stand-in takes the host's: its bits are then a
direct CPU run's.

Under `torch.use_deterministic_algorithms(True)` (Lightning's `deterministic=True`, Hugging Face's
`enable_full_determinism`), `F.pad(mode="replicate")`, `F.interpolate` (bilinear, trilinear) and
`F.max_pool3d(return_indices=True)` hand a CUDA tensor to a Python decomposition whose backward
avoids CUDA's atomic adds; the CPU runs its kernels, which are deterministic. For stand-ins those
decompositions give way to the CPU's kernels: the decompositions differed in the low bits, and
the two that make index tensors with `device=input.device` failed (they ran outside the device
mode).

`AveragedModel.update_parameters` (stochastic weight averaging) averages with foreach kernels on
devices that have them and tensor by tensor on the host, which rounds differently: for
stand-ins it averages tensor by tensor.
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


def _patch_decompositions(decompositions: ModuleType) -> None:
    for name, wrap in _TAKEN_AS_ON_THE_CPU.items():
        setattr(decompositions, name, wrap(getattr(decompositions, name)))


def _patch_weight_averaging(swa_utils: ModuleType) -> None:
    supported = swa_utils._get_foreach_kernels_supported_devices

    def foreach_devices() -> list[str]:
        """Device types averaged by foreach kernels: not the proxied devices."""
        return [kind for kind in supported() if kind != "cuda"]

    swa_utils._get_foreach_kernels_supported_devices = foreach_devices  # type: ignore[attr-defined]


def install() -> None:
    """Send stand-ins the host's way, once the modules that choose are imported."""
    patch_modules(
        {
            "torch._decomp.decompositions": _patch_decompositions,
            "torch.optim.swa_utils": _patch_weight_averaging,
        }
    )
