# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""`torch.compile` in a job on proxied devices: the model runs eagerly, as it would uncompiled.

torch's compilers generate kernels for the device they see (inductor writes Triton for cuda,
which a job without CUDA cannot build, and fails with "PyTorch is not linked with support for
cuda devices"), and operations on stand-ins are carried out by the proxy server anyway. So
`torch.compile(model)` returns what it returns when compilation is disabled for a module,
an `OptimizedModule` around it (same `_orig_mod.` state-dict keys as a compiled model) that
calls it eagerly, and a function unchanged; the program is told once, on stderr, when it compiles
something itself (torch compiles its own helpers too: `torch.cond` run eagerly, for one).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

NOTICE = (
    "proxy: torch.compile is not available on proxied devices; the model runs eagerly "
    "(the same results as without torch.compile)\n"
)
_told: list[bool] = []


def _tell_once() -> None:
    if not _told:
        _told.append(True)
        sys.stderr.write(NOTICE)
        sys.stderr.flush()


def compile(model: Any = None, **options: Any) -> Any:
    """What `torch.compile` returns on proxied devices: the model, run eagerly."""
    if model is None:  # used as @torch.compile(...)
        return lambda function: compile(function, **options)
    if options.get("disable"):
        return model
    if not str(sys._getframe(1).f_globals.get("__name__", "")).startswith("torch."):
        _tell_once()
    if isinstance(model, torch.nn.Module):
        from torch._dynamo.eval_frame import DisableContext, OptimizedModule

        return OptimizedModule(model, DisableContext())
    return model


def patch_compile() -> None:
    """Make `torch.compile` run models eagerly."""
    torch.compile = compile  # type: ignore[assignment]
