# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""Pickling stand-ins: torch.save and torch.load files as torch writes them for real cuda tensors,
other pickles as torch makes them, and no sharing with other processes.

Saving pickles a stand-in as a host copy of its values tagged with the location `cuda:N`,
so the file loads anywhere (with `map_location`) as if a CUDA machine had written it.
Loading honours `map_location` and puts cuda-mapped tensors on the proxied devices.
Any other pickle (object collectives, pickle.dumps) unpickles a stand-in onto its device;
multiprocessing's, which would share its memory with another process, is refused.
"""

from __future__ import annotations

from collections import OrderedDict
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from .devices import device_index
from .tensor import ProxyTensor, download
from .transfers import upload

SHARING_REFUSED = (
    "proxy: a CUDA tensor cannot be sent to another process on proxied devices (CUDA IPC is not "
    "served): send a CPU copy (tensor.cpu()) or create the tensor in that process"
)
EXPORT_REFUSED = (
    "proxy: a tensor on a proxied device cannot be handed to another library by its memory (DLPack, "
    "__cuda_array_interface__): its memory is in the proxy server; hand over tensor.cpu()"
)

_latest_copy: list[tuple[torch.Tensor, str]] = []
"""The latest host copy made by torch.save pickling a stand-in, with its location tag, kept (and
so its address) until the next: a pickler saves a tensor's storage, tagging its location, right
after the tensor's reduction, before the next object, so one copy at a time is tagged."""


_saves_under_way = 0
"""torch.save calls running: their pickles write storages tagged with a location; any other pickle
(object collectives, pickle.dumps) rebuilds a stand-in on its device from its values."""


class _Reduced:
    """An object that pickles as the reduction it is given."""

    def __init__(self, reduction: tuple[Any, ...]) -> None:
        self.reduction = reduction

    def __reduce__(self) -> tuple[Any, ...]:
        return self.reduction


def _rebuilt_on_device(host: torch.Tensor, stand_in: ProxyTensor) -> tuple[Any, ...] | None:
    """The reduction that makes the unpickling torch build the tensor on its cuda device from its
    values (torch's own function, as it pickles XLA tensors), so a proxied receiver gets a stand-in
    and a GPU one a cuda tensor; None for a dtype numpy cannot hold."""
    try:
        values = (host.float() if host.dtype == torch.bfloat16 else host).numpy()
    except TypeError:
        return None
    requires_grad = stand_in.requires_grad and stand_in.is_leaf
    return (
        torch._utils._rebuild_device_tensor_from_numpy,
        (values, host.dtype, str(stand_in.device), requires_grad),
    )


def reduce_as_cuda_tensor(stand_in: ProxyTensor, proto: Any) -> Any:
    """Pickle as a real cuda tensor would: in torch.save, values plus a 'cuda:N' location tag;
    elsewhere, a tensor that unpickles onto cuda:N."""
    with torch.no_grad():
        host = download(stand_in)
    is_param = getattr(stand_in, "_is_param", False)
    rebuilt = None if _saves_under_way else _rebuilt_on_device(host, stand_in)
    if rebuilt is not None:
        if is_param:
            return (
                torch._utils._rebuild_parameter,
                (_Reduced(rebuilt), stand_in.requires_grad, OrderedDict()),
            )
        return rebuilt
    _latest_copy[:] = [(host, str(stand_in.device))]
    if is_param:
        return (torch._utils._rebuild_parameter, (host, stand_in.requires_grad, OrderedDict()))
    if stand_in.requires_grad and stand_in.is_leaf:
        host.requires_grad_(True)
    return host.__reduce_ex__(proto)


def _location_tag(storage: Any) -> str | None:
    """torch.serialization's tagger: the cuda location of a copy made from a stand-in."""
    if getattr(storage, "device", None) is not None and storage.device.type == "cpu":
        for host, location in _latest_copy:
            if host.untyped_storage().data_ptr() == storage.data_ptr():
                return location
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


class _BoundForDevice:
    """A loaded host storage and the cuda location a callable `map_location` sent it to."""

    def __init__(self, storage: Any, location: str) -> None:
        self.storage = storage
        self.location = location


class _StorageToMap:
    """The storage a callable `map_location` is given (`lambda storage, loc: storage.cuda(gpu)`):
    its `.cuda()` and `.to("cuda...")` name the device its tensors go to once loaded (a host storage
    cannot become a device one here); anything else is the storage's own."""

    def __init__(self, storage: Any) -> None:
        self._storage = storage

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)

    def cuda(self, device: Any = None, non_blocking: bool = False) -> _BoundForDevice:
        return _BoundForDevice(self._storage, f"cuda:{device_index(device)}")

    def to(self, *args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device", args[0] if args else None)
        if device is not None and torch.device(device).type == "cuda":
            return self.cuda(device)
        return self._storage.to(*args, **kwargs)


def _restored_by(map_location: Any, storage: Any, location: str) -> tuple[Any, str]:
    """What a callable `map_location` makes of a loaded storage: the storage to load into and the
    location its tensors go to (its own when the callable returns None)."""
    restored = map_location(_StorageToMap(storage), location)
    if restored is None:
        return storage, location
    if isinstance(restored, _BoundForDevice):
        return restored.storage, restored.location
    if isinstance(restored, _StorageToMap):
        restored = restored._storage
    return restored, "cpu"


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


def refuse_sharing(stand_in: ProxyTensor) -> Any:
    """multiprocessing's pickler (a spawned Process's arguments, a Queue) would share a CUDA
    tensor's memory with the other process; a copy would let the two go on apart, silently."""
    raise RuntimeError(SHARING_REFUSED)


def refuse_export(stand_in: Any) -> Any:
    """DLPack and the CUDA array interface would give another library (numpy, CuPy) the address of
    the stand-in's empty host wrapper, which it would read as the tensor's values."""
    raise BufferError(EXPORT_REFUSED)


def install() -> None:
    """Make stand-ins pickle as cuda tensors, and torch.save / torch.load handle them; refuse to
    send them to another process."""
    ProxyTensor.__reduce_ex__ = reduce_as_cuda_tensor  # type: ignore[assignment,method-assign]
    ForkingPickler.register(ProxyTensor, refuse_sharing)
    dlpack: Any = torch.utils.dlpack
    to_dlpack, from_dlpack = dlpack.to_dlpack, dlpack.from_dlpack

    def to_dlpack_of_host_tensors(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(tensor, ProxyTensor):
            refuse_export(tensor)
        return to_dlpack(tensor, *args, **kwargs)

    def from_dlpack_or_stand_in(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        """A stand-in given to torch's from_dlpack: the tensor viewing its memory, as on a GPU."""
        if isinstance(tensor, ProxyTensor):
            return tensor.detach()
        return from_dlpack(tensor, *args, **kwargs)

    top: Any = torch
    dlpack.to_dlpack = to_dlpack_of_host_tensors
    dlpack.from_dlpack = top.from_dlpack = from_dlpack_or_stand_in
    torch.serialization.register_package(1, _location_tag, lambda obj, location: None)
    original_load = torch.load

    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        targets: dict[int, str] = {}

        def restore(storage: Any, location: str) -> Any:
            if callable(map_location) and not isinstance(map_location, (dict, str, torch.device)):
                storage, target = _restored_by(map_location, storage, location)
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
        global _saves_under_way
        _saves_under_way += 1
        try:
            original_save(obj, f, *args, **kwargs)
        finally:
            _saves_under_way -= 1

    torch.save = save
    _patch_torchscript()


SCRIPT_SAVE_REFUSED = (
    "proxy: TorchScript cannot save tensors of a proxied device (its serializer reads their memory "
    "itself): save a scripted host copy of the module, or its state_dict() with torch.save"
)


def _move_script_tensors(module: Any, device: torch.device) -> None:
    """Put a loaded TorchScript module's parameters and buffers on `device`, slot by slot (its C++
    holds them: `Module.to` would make new Parameter objects, which a script module refuses)."""
    for submodule in module.modules():
        for slots in (submodule._parameters, submodule._buffers):
            for name, tensor in list(slots.items()):
                if tensor is not None:
                    slots[name] = tensor.detach().to(device).requires_grad_(tensor.requires_grad)


def _patch_torchscript() -> None:
    """`torch.jit.save` of a module holding stand-ins is refused (it wrote zeros: TorchScript's C++
    reads a tensor's memory, which a stand-in does not have); `torch.jit.load` onto a cuda device
    loads on the host and moves the module there, as TorchScript's C++ has no CUDA here."""
    jit: Any = torch.jit
    original_save, original_load = jit.save, jit.load
    script_module = jit.RecursiveScriptModule
    module_save = script_module.save

    def refuse_stand_ins(module: Any) -> None:
        if isinstance(module, torch.nn.Module):
            tensors = [*module.parameters(), *module.buffers()]
            if any(isinstance(tensor, ProxyTensor) for tensor in tensors):
                raise RuntimeError(SCRIPT_SAVE_REFUSED)

    def save(m: Any, f: Any, _extra_files: Any = None) -> None:
        refuse_stand_ins(m)
        original_save(m, f, _extra_files)

    def save_method(self: Any, f: Any, **kwargs: Any) -> Any:
        refuse_stand_ins(self)
        return module_save(self, f, **kwargs)

    def load(
        f: Any, map_location: Any = None, _extra_files: Any = None, _restore_shapes: bool = False
    ) -> Any:
        target = map_location if isinstance(map_location, (str, torch.device, int)) else None
        if target is not None and torch.device(target).type == "cuda":
            loaded = original_load(f, "cpu", _extra_files, _restore_shapes)
            _move_script_tensors(loaded, torch.device(target))
            return loaded
        return original_load(f, map_location, _extra_files, _restore_shapes)

    jit.save, jit.load, script_module.save = save, load, save_method
