"""Refusing what CUDA refuses: one call from the program mixing cuda tensors with host tensors,
or with another device's (with stand-ins, whose C++ device is the host, torch would not notice)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from .devices import same_device_error
from .tensor import ProxyTensor

_Tensor = torch.Tensor
_F = torch.nn.functional
_IS_FUNCTORCH_WRAPPED = torch._C._functorch.is_functorch_wrapped_tensor
_UNWRAPPED = torch._C._functorch.get_unwrapped
CLIENT_PACKAGE = __name__.rsplit(".", 1)[0]


def is_cuda(device: Any) -> bool:
    """Whether a device argument (a device, its name, or a bare index) names a cuda device."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def called_by_client(frame: Any) -> bool:
    """Whether the code running in `frame` is this client's own."""
    return str(frame.f_globals.get("__name__")).startswith(CLIENT_PACKAGE)


def caller_module() -> str:
    """The module of the torch function's caller: the first frame outside this package."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        if not name.startswith(CLIENT_PACKAGE) and name != "torch.overrides":
            return name
        frame = frame.f_back
    return ""


def from_torch_internals() -> bool:
    """Whether the caller of the torch function is torch's own Python code."""
    return caller_module().startswith("torch.")


MIXING_ALLOWED = {
    _Tensor.view_as,  # the other tensor gives only its shape
    _Tensor.reshape_as,
    _Tensor.expand_as,
    _Tensor.resize_as_,
    _Tensor.tensor_split,  # indices given as a tensor are on the host, as torch requires
    torch.tensor_split,
    _Tensor.__getitem__,
    _Tensor.__setitem__,
    _Tensor.copy_,
    _Tensor.index_put_,
    _Tensor.index_put,
    torch.index_put,
    _Tensor.__reduce_ex__,
    _Tensor.__deepcopy__,
    torch._has_compatible_shallow_copy_type,  # compares the kinds of two tensors
}
"""Calls that legitimately take host and device tensors together (as they do on CUDA)."""
CHECKED_INSIDE_TORCH = frozenset(
    {
        torch._C._nn.linear, torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d,
        torch.conv_transpose2d, torch.conv_transpose3d, torch.embedding, torch.layer_norm,
        torch.group_norm, torch.batch_norm, torch.instance_norm, torch.bilinear,
        torch._C._nn.cross_entropy_loss, torch._C._nn.nll_loss_nd, torch._C._nn.mse_loss,
        torch._C._nn.l1_loss, torch._C._nn.smooth_l1_loss, torch._C._nn.huber_loss,
        torch._C._nn.binary_cross_entropy, torch.binary_cross_entropy_with_logits,
        torch.kl_div, torch.cosine_similarity, torch.pairwise_distance,
        _F.embedding, _F.layer_norm, _F.group_norm, _F.batch_norm, _F.instance_norm,
        _F.cross_entropy, _F.nll_loss, _F.mse_loss, _F.l1_loss, _F.smooth_l1_loss, _F.huber_loss,
        _F.binary_cross_entropy, _F.binary_cross_entropy_with_logits, _F.kl_div,
    }
)  # fmt: skip
"""Calls checked even where torch's own Python code makes them (a module's forward, a loss):
their tensors are the program's (its input, its target against its parameters), which CUDA
refuses to mix, while other calls of torch's internals may take host tensors by design."""
LISTS_OF_TENSORS = frozenset(
    {torch.cat, torch.concat, torch.concatenate, torch.stack, torch.hstack, torch.vstack,
     torch.dstack, torch.column_stack, torch.row_stack}
)  # fmt: skip
"""Calls given their tensors as one list, checked as calls of several tensors are."""
HOST_FROM: dict[Any, int] = dict.fromkeys(
    (torch._foreach_addcdiv, torch._foreach_addcdiv_, torch._foreach_addcmul, torch._foreach_addcmul_), 3
)
"""Calls whose arguments from this position on may be host tensors (a `scalars` tensor, which
CUDA's kernels read on the host); the ones before it are checked."""


def stand_in_of(tensor: torch.Tensor) -> ProxyTensor | None:
    """The stand-in a tensor is, or that torch.func's transforms wrap (`vmap`'s batched tensors,
    `grad`'s gradient-tracking ones, whose C++ device is the host's like the stand-in's); None
    for a host tensor."""
    while _IS_FUNCTORCH_WRAPPED(tensor):
        tensor = _UNWRAPPED(tensor)
    return tensor if isinstance(tensor, ProxyTensor) else None


def check_devices(args: Sequence[Any], inside_torch_too: bool = False) -> None:
    """Raise what CUDA raises when one call mixes cuda tensors and (non-scalar) host tensors (a
    call from torch's own code only where `inside_torch_too`)."""
    device = host = None
    channels_differ = False
    for arg in args:
        kind = type(arg)
        if kind is ProxyTensor:
            if device is None:
                device = arg
            elif arg._channel is not device._channel:
                channels_differ = True
        elif kind is list or kind is tuple:
            for item in arg:
                if type(item) is ProxyTensor:
                    device = item if device is None else device
                elif isinstance(item, torch.Tensor):
                    stand_in = stand_in_of(item)
                    if stand_in is not None:
                        device = stand_in if device is None else device
                    elif item.dim() > 0:
                        host = item if host is None else host
        elif isinstance(arg, torch.Tensor) and arg.dim() > 0:
            stand_in = stand_in_of(arg)
            if stand_in is not None:
                device = stand_in if device is None else device
            else:
                host = arg if host is None else host
    if device is None or (host is None and not channels_differ):
        return
    if not inside_torch_too and from_torch_internals():
        return
    for arg in args:
        stand_in = stand_in_of(arg) if isinstance(arg, torch.Tensor) else None
        if stand_in is not None and stand_in._channel is not device._channel:
            raise same_device_error(str(device.device), str(stand_in.device))
    if host is not None:
        raise same_device_error(str(device.device), str(host.device))
