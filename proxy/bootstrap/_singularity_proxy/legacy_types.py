"""The legacy tensor types of cuda (`torch.cuda.FloatTensor` and kin) for stand-ins.

Older programs (and many still copied from them) write `Tensor = torch.cuda.FloatTensor`, then
`Tensor(batch, 1).fill_(1.0)`, `Tensor(numpy_array)`, `images.type(Tensor)` and
`isinstance(x, torch.cuda.FloatTensor)`. A CPU build of torch has only placeholders that refuse;
here each type makes stand-ins on the current device, converts to them, and recognises them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

DTYPES = {
    "FloatTensor": torch.float32,
    "DoubleTensor": torch.float64,
    "HalfTensor": torch.float16,
    "BFloat16Tensor": torch.bfloat16,
    "ByteTensor": torch.uint8,
    "CharTensor": torch.int8,
    "ShortTensor": torch.int16,
    "IntTensor": torch.int32,
    "LongTensor": torch.int64,
    "BoolTensor": torch.bool,
}
"""Each legacy type's name and the dtype of its tensors."""
NAMES = {dtype: name for name, dtype in DTYPES.items()}


class _CudaTensorType(type):
    """The metaclass of the cuda legacy types: a tensor is an instance when it is on a cuda
    device and of the type's dtype."""

    dtype: torch.dtype

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, torch.Tensor) and instance.is_cuda and instance.dtype == cls.dtype


def _current() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _construct(dtype: torch.dtype, args: Sequence[Any]) -> torch.Tensor:
    """What `torch.cuda.<Type>Tensor(*args)` gives: sizes make an uninitialised tensor, data (a
    sequence, an array, a tensor) a tensor holding it, nothing an empty one."""
    device = _current()
    if not args:
        return torch.empty(0, dtype=dtype, device=device)
    if all(isinstance(a, int) for a in args):
        return torch.empty(args, dtype=dtype, device=device)
    if len(args) == 1 and isinstance(args[0], torch.Size):
        return torch.empty(args[0], dtype=dtype, device=device)
    if len(args) == 1 and isinstance(args[0], torch.Tensor):
        return args[0].to(device=device, dtype=dtype)
    if len(args) == 1:
        return torch.tensor(args[0], dtype=dtype, device=device)
    raise TypeError(f"torch.cuda.{NAMES[dtype]}(): sizes (ints), a torch.Size or data are expected")


def _legacy_type(name: str, dtype: torch.dtype) -> type:
    def __new__(cls: type, *args: Any, **kwargs: Any) -> torch.Tensor:
        return _construct(dtype, args)

    members = {
        "__new__": __new__,
        "dtype": dtype,
        "is_cuda": True,
        "is_sparse": False,
        "__module__": "torch.cuda",
    }
    return _CudaTensorType(name, (), members)


def type_name(tensor: torch.Tensor) -> str:
    """What `Tensor.type()` says of a stand-in: its cuda legacy type's full name."""
    return f"torch.cuda.{NAMES.get(tensor.dtype, 'FloatTensor')}"


def type_target(spec: Any) -> tuple[bool, torch.dtype] | None:
    """Whether a `Tensor.type` argument names a cuda legacy type (else a host one), and its dtype;
    None when it names neither (a dtype, or another type)."""
    if isinstance(spec, str):
        module, _, name = spec.rpartition(".")
    elif isinstance(spec, type):
        module, name = spec.__module__, spec.__name__
    else:
        return None
    if name not in DTYPES or module not in ("torch", "torch.cuda"):
        return None
    return module == "torch.cuda", DTYPES[name]


def install() -> None:
    """Put the cuda legacy types in torch.cuda."""
    for name, dtype in DTYPES.items():
        setattr(torch.cuda, name, _legacy_type(name, dtype))
