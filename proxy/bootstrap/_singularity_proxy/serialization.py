# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""torch.save and torch.load of stand-ins: files as torch writes them for real cuda tensors.

Saving pickles a stand-in as a host copy of its values tagged with the location `cuda:N`,
so the file loads anywhere (with `map_location`) as if a CUDA machine had written it.
Loading honours `map_location` and puts cuda-mapped tensors on the proxied devices.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from .devices import device_index
from .tensor import ProxyTensor, download
from .transfers import upload

_location_of_copy: dict[int, str] = {}
"""Storage address of each host copy made while saving -> the location tag it is saved with."""
_copies_being_saved: list[torch.Tensor] = []
"""Keeps those copies (and so their addresses) alive until the save ends."""


def _forget_copies() -> None:
    """Forget the host copies made while pickling stand-ins."""
    _location_of_copy.clear()
    _copies_being_saved.clear()


def reduce_as_cuda_tensor(stand_in: ProxyTensor, proto: Any) -> Any:
    """Pickle as a real cuda tensor would: values plus a 'cuda:N' location tag."""
    with torch.no_grad():
        host = download(stand_in)
    _location_of_copy[host.untyped_storage().data_ptr()] = str(stand_in.device)
    _copies_being_saved.append(host)
    if getattr(stand_in, "_is_param", False):
        return (torch._utils._rebuild_parameter, (host, stand_in.requires_grad, OrderedDict()))
    if stand_in.requires_grad and stand_in.is_leaf:
        host.requires_grad_(True)
    return host.__reduce_ex__(proto)


def _location_tag(storage: Any) -> str | None:
    """torch.serialization's tagger: the cuda location of a copy made from a stand-in."""
    if getattr(storage, "device", None) is not None and storage.device.type == "cpu":
        return _location_of_copy.get(storage.data_ptr())
    return None


def _mapped_location(map_location: Any, location: str) -> str:
    """Where `map_location` (None, a dict, a string or a device) sends a saved location."""
    if map_location is None:
        return location
    if isinstance(map_location, dict):
        return str(map_location.get(location, location))
    if isinstance(map_location, (str, torch.device)):
        return str(map_location)
    return location


def _place(obj: Any, targets: dict[int, str], memo: dict[int, Any]) -> Any:
    """Move the loaded tensors whose storage was mapped to a cuda location onto it."""
    if id(obj) in memo:
        return memo[id(obj)]
    out: Any = obj
    if isinstance(obj, torch.Tensor) and not isinstance(obj, ProxyTensor):
        target = targets.get(obj.untyped_storage().data_ptr()) if obj.device.type == "cpu" else None
        if target is not None:
            with torch.no_grad():
                moved: Any = upload(obj.detach(), device_index(target))
            if isinstance(obj, torch.nn.Parameter):
                out = torch.nn.Parameter(moved, requires_grad=obj.requires_grad)
            else:
                out = moved.requires_grad_(obj.requires_grad) if obj.is_leaf else moved
    elif isinstance(obj, dict):
        items = [(k, _place(v, targets, memo)) for k, v in obj.items()]
        try:
            out = type(obj)(items)
        except Exception:
            out = dict(items)
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
    elif isinstance(obj, list):
        out = [_place(v, targets, memo) for v in obj]
    elif isinstance(obj, tuple):
        values = [_place(v, targets, memo) for v in obj]
        out = type(obj)(*values) if hasattr(obj, "_fields") else tuple(values)
    elif isinstance(obj, torch.nn.Module):
        obj._apply(lambda t: _place(t, targets, memo))
    memo[id(obj)] = out
    return out


def install() -> None:
    """Make stand-ins pickle as cuda tensors, and torch.save / torch.load handle them."""
    ProxyTensor.__reduce_ex__ = reduce_as_cuda_tensor  # type: ignore[assignment,method-assign]
    torch.serialization.register_package(1, _location_tag, lambda obj, location: None)
    original_load = torch.load

    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        targets: dict[int, str] = {}

        def restore(storage: Any, location: str) -> Any:
            if callable(map_location) and not isinstance(map_location, (dict, str, torch.device)):
                restored = map_location(storage, location)
                if restored is not None:
                    return restored
                target = location
            else:
                target = _mapped_location(map_location, location)
            if target.startswith("cuda"):
                targets[storage.data_ptr()] = target
            return storage

        obj = original_load(f, restore, *args, **kwargs)
        if not targets:
            return obj
        return _place(obj, targets, {})

    torch.load = load
    original_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        try:
            original_save(obj, f, *args, **kwargs)
        finally:
            _forget_copies()

    torch.save = save
