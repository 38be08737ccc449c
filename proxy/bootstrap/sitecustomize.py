"""Activates the singularity device proxy in a job process, and chains to any other sitecustomize.

The daemon's launcher puts this directory first on the job's PYTHONPATH. Without
SING_PROXY_SOCKETS in the environment nothing happens beyond the chaining. With it,
the client is installed right after the program first imports torch, so processes of
the job that never use torch pay nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))


def _chain() -> None:
    """Run the sitecustomize that Python would have found without this directory."""
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)


class _TorchHook(importlib.abc.MetaPathFinder):
    """Installs the proxy client once `torch` has finished importing."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        orig = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            orig(module)
            if _HERE not in sys.path:
                sys.path.append(_HERE)
            import _singularity_proxy  # type: ignore[import-not-found,unused-ignore]

            _singularity_proxy.activate()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_chain()
if os.environ.get("SING_PROXY_SOCKETS"):
    if "torch" in sys.modules:
        import _singularity_proxy  # type: ignore[import-not-found,unused-ignore]

        _singularity_proxy.activate()
    else:
        sys.meta_path.insert(0, _TorchHook())
