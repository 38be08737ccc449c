"""torch.cuda.comm's copies between devices (broadcast, scatter, gather) for stand-ins.

`nn.DataParallel` (one process driving every device) calls these C++ functions, which a CPU
build of torch lacks and a CUDA build runs on the driver. They only move bytes between devices,
so they are written here with the stand-ins' own copies, and give what CUDA's give: the source
device's tensors themselves where CUDA returns them, copies elsewhere, chunks of a scatter already
on their device as views.
Streams are accepted and unused (work on a device runs in order). Sums across devices
(`reduce_add`) are torch's Python already.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def _on(index: int) -> torch.device:
    return torch.device("cuda", index)


def broadcast(tensor: torch.Tensor, devices: Sequence[int]) -> list[torch.Tensor]:
    """`tensor` on each of `devices`: itself on its own device, a copy on the others."""
    return [tensor if tensor.device == _on(d) else tensor.to(_on(d), copy=True) for d in devices]


def broadcast_out(tensor: torch.Tensor, out: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copy `tensor` into each of `out`."""
    for target in out:
        target.copy_(tensor)
    return list(out)


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], devices: Sequence[int], buffer_size: int = 0
) -> list[list[torch.Tensor]]:
    """The tensors (all on `devices[0]`) on each device: themselves first, copies after."""
    for tensor in tensors:
        if tensor.device != _on(devices[0]):
            raise RuntimeError(
                f"all tensors must be on devices[0]: {devices[0]}, but got a tensor on {tensor.device}"
            )
    return [list(tensors), *([t.to(_on(d), copy=True) for t in tensors] for d in devices[1:])]


def scatter(
    tensor: torch.Tensor,
    devices: Sequence[int],
    chunk_sizes: Sequence[int] | None = None,
    dim: int = 0,
    streams: Any = None,
) -> list[torch.Tensor]:
    """`tensor` cut along `dim` (into `chunk_sizes`, else evenly), one piece per device."""
    if chunk_sizes is None:
        chunks = tensor.chunk(len(devices), dim)
    else:
        chunks = tensor.split_with_sizes(list(chunk_sizes), dim)
    return [chunk.to(_on(d)) for chunk, d in zip(chunks, devices, strict=True)]


def scatter_out(
    tensor: torch.Tensor, out: Sequence[torch.Tensor], dim: int = 0, streams: Any = None
) -> list[torch.Tensor]:
    """`tensor` cut along `dim` into the sizes of `out`, copied into them."""
    chunks = tensor.split_with_sizes([target.size(dim) for target in out], dim)
    for target, chunk in zip(out, chunks, strict=True):
        target.copy_(chunk)
    return list(out)


def gather(tensors: Sequence[torch.Tensor], dim: int = 0, destination: int | None = None) -> torch.Tensor:
    """The tensors joined along `dim` on `destination` (-1: the CPU; None: the current device)."""
    if destination == -1:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", torch.cuda.current_device() if destination is None else destination)
    return torch.cat([t.to(device) for t in tensors], dim)


def gather_out(tensors: Sequence[torch.Tensor], out: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """The tensors joined along `dim`, copied into `out`."""
    offset = 0
    for tensor in tensors:
        out.narrow(dim, offset, tensor.size(dim)).copy_(tensor)
        offset += tensor.size(dim)
    return out


FUNCTIONS = {
    "_broadcast": broadcast,
    "_broadcast_out": broadcast_out,
    "_broadcast_coalesced": broadcast_coalesced,
    "_scatter": scatter,
    "_scatter_out": scatter_out,
    "_gather": gather,
    "_gather_out": gather_out,
}


def install() -> None:
    """Put these in torch._C, where torch.cuda.comm looks them up at each call (a CUDA build's
    own would reach the driver with tensors whose C++ device is the host)."""
    for name, function in FUNCTIONS.items():
        setattr(torch._C, name, function)
