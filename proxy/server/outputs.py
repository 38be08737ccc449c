"""What an operator's outputs are: the new bytes their templates announce, the layouts of `out=`
arguments it resized, the bytes it would allocate (found on meta tensors), and the check that every
strided tensor lies within its storage; the executor (executor.py) consults these per operation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from singularity.proxy.bootstrap._singularity_proxy import protocol

_NAMES = protocol.torch_names()


def template_new_bytes(template: Any) -> list[int]:
    """Bytes of new storage of each new tensor in an output template."""
    if template[0] == protocol.TEMPLATE_TENSOR:
        return [template[5]]
    if template[0] == protocol.TEMPLATE_SPARSE:
        return [template[4]]
    if template[0] in (protocol.TEMPLATE_LIST, protocol.TEMPLATE_TUPLE):
        return [nbytes for item in template[1] for nbytes in template_new_bytes(item)]
    return []


def raw_values(tensor: torch.Tensor) -> list[Any]:
    """[dtype, shape, stride, bytes] of a tensor's values, as REQ_FETCH answers them."""
    host, raw = protocol.tensor_to_raw(tensor)
    return [_NAMES.dtype_names[host.dtype], list(host.shape), list(host.stride()), raw]


def check_within_storages(values: Sequence[Any]) -> None:
    """RuntimeError unless each strided tensor among `values` lies within its storage's bytes (the
    kernels read and write without that check, so a view of a storage resized smaller would crash
    the server)."""
    for value in values:
        if type(value) is torch.Tensor and value.layout == torch.strided:
            shape, stride, offset = value.shape, value.stride(), int(value.storage_offset())
            needed = protocol.storage_extent(shape, stride, offset) * value.itemsize
            held = value.untyped_storage().nbytes()
            if needed > held:
                raise RuntimeError(
                    f"proxy: sizes {list(shape)}, strides {list(stride)}, storage offset {offset}, and "
                    f"itemsize {value.itemsize} requiring a storage size of {needed} are out of bounds "
                    f"for storage of size {held} (the storage was resized smaller)"
                )


def layout_of(tensor: torch.Tensor) -> list[Any]:
    """[shape, stride, storage offset] of a tensor, as templates carry them."""
    return [list(tensor.shape), list(tensor.stride()), tensor.storage_offset()]


def resized_outputs(template: Any, layouts_before: list[Any], inputs: list[torch.Tensor]) -> Any:
    """An output template in which each returned input whose layout the operation changed (an
    `out=` argument it resized) is reported as reshaped, so the job's stand-in takes the layout."""
    tag = template[0]
    if tag == protocol.TEMPLATE_ALIAS:
        layout = layout_of(inputs[template[1]])
        if layout != layouts_before[template[1]]:
            return [protocol.TEMPLATE_RESHAPED, template[1], *layout]
    elif tag in (protocol.TEMPLATE_LIST, protocol.TEMPLATE_TUPLE):
        return [tag, [resized_outputs(item, layouts_before, inputs) for item in template[1]]]
    return template


def meta_growth(operator: Any, args: list[Any], kwargs: dict[str, Any]) -> int:
    """Bytes an operator would allocate, found by running it on meta tensors shaped like the inputs."""
    real_bytes: dict[int, int] = {}

    def to_meta(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
            real_bytes[meta.untyped_storage()._cdata] = value.untyped_storage().nbytes()
            return meta
        if isinstance(value, torch.device):
            return torch.device("meta")
        if type(value) is list:
            return [to_meta(item) for item in value]
        return value

    output = operator(*[to_meta(a) for a in args], **{k: to_meta(v) for k, v in kwargs.items()})
    outputs = output if isinstance(output, (list, tuple)) else [output]
    growth = 0
    for tensor in outputs:
        if isinstance(tensor, torch.Tensor):
            storage = tensor.untyped_storage()
            growth += max(0, storage.nbytes() - real_bytes.get(storage._cdata, 0))
    return growth
