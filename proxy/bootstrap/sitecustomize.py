"""Activates the singularity device proxy in a job process, and chains to any other sitecustomize.

The daemon's launcher puts this directory first on the job's PYTHONPATH. Right after the program
first imports torch (processes of the job that never use torch pay nothing): with USE_LIBUV=0
(the daemon's default) torch's TCPStore defaults to its plain backend and RPC to TensorPipe's
shared-memory transport, which CRIU can dump (_singularity_proxy.stores); with SING_PROXY_SOCKETS
the client is installed. In every process, multiprocessing's named semaphores are mapped so that
CRIU can dump them (_singularity_proxy.semaphores).
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
    """Runs `_torch_imported` once `torch` has finished importing."""

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
            _torch_imported()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _client_importable() -> None:
    """Let this process import the in-job client's package (after the program's own paths)."""
    if _HERE not in sys.path:
        sys.path.append(_HERE)


def _semaphores_mapped_by_name() -> None:
    """Patch multiprocessing's semaphores once the program imports them."""
    _client_importable()
    from _singularity_proxy import on_import, semaphores  # type: ignore[import-not-found,unused-ignore]

    on_import.patch_modules({"multiprocessing.synchronize": semaphores.map_by_name})


def _torch_imported() -> None:
    """What the job's environment asks for once torch is imported."""
    _client_importable()
    import _singularity_proxy  # type: ignore[import-not-found,unused-ignore]
    from _singularity_proxy import on_import, stores  # type: ignore[import-not-found,unused-ignore]

    if stores.wanted():
        stores.default_without_libuv()
        on_import.patch_modules({"torch.distributed.rpc.options": stores.rpc_without_libuv})
    _singularity_proxy.activate()


_chain()
_semaphores_mapped_by_name()
if os.environ.get("SING_PROXY_SOCKETS") or os.environ.get("USE_LIBUV") == "0":
    if "torch" in sys.modules:
        _torch_imported()
    else:
        sys.meta_path.insert(0, _TorchHook())
