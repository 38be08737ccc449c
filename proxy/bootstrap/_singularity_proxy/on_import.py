"""Patches of modules that programs import late (DTensor, RPC, multiprocessing's semaphores): made
when the module is imported, so that a program that never imports them does not pay for it."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

Patch = Callable[[ModuleType], None]


def patch_modules(patches: dict[str, Patch]) -> None:
    """Patch each named module now if it is imported, else once it is."""
    finder = next((found for found in sys.meta_path if isinstance(found, _PatchOnImport)), None)
    for name, patch in patches.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
            continue
        if finder is None:
            finder = _PatchOnImport()
            sys.meta_path.insert(0, finder)
        finder.patches.setdefault(name, []).append(patch)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the modules to patch as the other finders do, and patches each once it has run."""

    def __init__(self) -> None:
        self.patches: dict[str, list[Patch]] = {}
        self._finding = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patches = self.patches.get(fullname)
        if patches is None or self._finding:
            return None
        self._finding = True
        try:
            spec = next(
                (
                    found
                    for finder in sys.meta_path
                    if finder is not self and hasattr(finder, "find_spec")
                    for found in [finder.find_spec(fullname, path, target)]
                    if found is not None
                ),
                None,
            )
        finally:
            self._finding = False
        loader: Any = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            for patch in patches:
                patch(module)
            self.patches.pop(fullname, None)
            if not self.patches and self in sys.meta_path:
                sys.meta_path.remove(self)

        loader.exec_module = exec_module
        return spec
