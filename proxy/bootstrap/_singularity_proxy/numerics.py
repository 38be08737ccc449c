"""The process-wide settings that change what torch's host kernels compute, which a job sets in
its own process and the proxy server must run that job's operations with (protocol.OP_SETTINGS).

- The default floating dtype (`torch.set_default_dtype`): the dtype of factories and of integer
  operands promoted to floats (`torch.arange(3) / 3`).
- The float32 precisions oneDNN computes with (`torch.set_float32_matmul_precision("medium")`
  makes the host's matrix products bfloat16 ones; `torch.backends.mkldnn.matmul.fp32_precision`
  and its convolution and RNN siblings) and whether oneDNN is used at all
  (`torch.backends.mkldnn.flags(enabled=False)`).

A job reads them before each operation it sends only when one may have changed (the setters bump
`VERSION`; the default dtype, which also decides the results' dtypes, is read every time). The
server applies a session's settings while it runs that session's operations and goes back to its
own afterwards (`apply`).
"""

from __future__ import annotations

from typing import Any

import torch

from . import protocol

FP32_PRECISIONS = (("generic", "all"), ("mkldnn", "matmul"), ("mkldnn", "conv"), ("mkldnn", "rnn"))
"""torch's float32 precision settings, (backend, operation), that change what the host computes."""
PRECISIONS = frozenset(("none", "ieee", "tf32", "bf16"))
"""The values a float32 precision setting takes."""
VERSION = [0]
"""Bumped by every call of the setters below in a job: its settings may have changed."""


def current() -> dict[str, Any]:
    """This process's settings, as OP_SETTINGS carries them."""
    getter = torch._C._get_fp32_precision_getter
    return {
        "default_dtype": protocol.torch_names().dtype_names[torch.get_default_dtype()],
        "mkldnn": bool(torch._C._get_mkldnn_enabled()),
        "fp32_precision": [getter(backend, operation) for backend, operation in FP32_PRECISIONS],
    }


def apply(settings: Any) -> None:
    """Make `settings` (as `current` gives them) this process's; ProtocolError for anything else."""
    if type(settings) is not dict or set(settings) != {"default_dtype", "mkldnn", "fp32_precision"}:
        raise protocol.ProtocolError(f"malformed settings {str(settings)[:100]}")
    dtype = protocol.torch_names().dtype(settings["default_dtype"])
    precisions = settings["fp32_precision"]
    if not dtype.is_floating_point or type(settings["mkldnn"]) is not bool:
        raise protocol.ProtocolError(f"malformed settings {str(settings)[:100]}")
    if type(precisions) is not list or len(precisions) != len(FP32_PRECISIONS):
        raise protocol.ProtocolError(f"malformed settings {str(settings)[:100]}")
    if any(precision not in PRECISIONS for precision in precisions):
        raise protocol.ProtocolError(f"unknown float32 precision in {precisions}")
    torch.set_default_dtype(dtype)
    torch._C._set_mkldnn_enabled(settings["mkldnn"])
    for (backend, operation), precision in zip(FP32_PRECISIONS, precisions, strict=True):
        torch._C._set_fp32_precision_setter(backend, operation, precision)


def watch() -> None:
    """Bump VERSION whenever the program changes a setting other than the default dtype."""
    native: Any = torch._C
    for name in ("_set_float32_matmul_precision", "_set_fp32_precision_setter", "_set_mkldnn_enabled"):
        setter = getattr(native, name)

        def changed(*args: Any, setter: Any = setter) -> Any:
            result = setter(*args)
            VERSION[0] += 1
            return result

        setattr(native, name, changed)
