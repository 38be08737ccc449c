# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""Sparse stand-ins (COO and the compressed layouts): made, uploaded, built and downloaded.

The server holds a sparse tensor whole under one handle; its stand-in carries shape, layout and
dtype (`prim.layout` answers its layout). It travels as its components, and the server builds it
only by the constructors that check indices against sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import protocol
from . import tensor as stand_ins
from .channel import Channel
from .tensor import HOST, ProxyTensor, SpecialHandler, TensorHandle, forward, upload_to

_NAMES = protocol.torch_names()


def new_sparse_stand_in(channel: Channel, handle: int, meta: tuple[Any, ...]) -> ProxyTensor:
    """The stand-in for sparse server tensor `handle`, with meta (shape, layout, 0, dtype).

    Its layout is answered through dispatch (`prim.layout`): torch keeps a compressed sparse
    layout (CSR, CSC, BSR, BSC) only in its own sparse tensor class.
    """
    tensor = torch.Tensor._make_wrapper_subclass(
        ProxyTensor, meta[0], dtype=meta[3], layout=meta[1], device=HOST, dispatch_layout=True
    )
    tensor._handle = TensorHandle(channel, handle)
    tensor._id = handle
    tensor._meta = meta
    tensor._channel = channel
    return tensor  # type: ignore[no-any-return]


def _layout_of(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`prim.layout` of a sparse stand-in."""
    return args[0]._meta[1]


def sparse_from_parts(answer: dict[str, Any]) -> torch.Tensor:
    """A host sparse tensor from the components REQ_FETCH sent."""
    parts = [protocol.tensor_from_raw(*part) for part in answer["parts"]]
    layout = _NAMES.layouts[answer["layout"]]
    if layout == torch.sparse_coo:
        indices, values = parts
        return torch.sparse_coo_tensor(indices, values, answer["shape"], is_coalesced=answer["coalesced"])
    compressed, plain, values = parts
    return torch.sparse_compressed_tensor(compressed, plain, values, answer["shape"], layout=layout)


_SPARSE_FACTORIES = {
    torch.sparse_coo: torch.ops.aten.sparse_coo_tensor.indices_size,
    torch.sparse_csr: torch.ops.aten.sparse_compressed_tensor.comp_plain_value_size,
    torch.sparse_csc: torch.ops.aten.sparse_compressed_tensor.comp_plain_value_size,
    torch.sparse_bsr: torch.ops.aten.sparse_compressed_tensor.comp_plain_value_size,
    torch.sparse_bsc: torch.ops.aten.sparse_compressed_tensor.comp_plain_value_size,
}


def upload_sparse(channel: Channel, tensor: torch.Tensor) -> ProxyTensor:
    """A sparse stand-in with a host sparse tensor's values: its components are uploaded and
    the server builds the tensor from them, checking its indices."""
    layout = tensor.layout
    if layout == torch.sparse_coo:
        parts = [tensor._indices(), tensor._values()]
        options: dict[str, Any] = {"is_coalesced": tensor.is_coalesced()}
    else:
        compressed, plain = (
            (tensor.crow_indices(), tensor.col_indices())
            if layout in (torch.sparse_csr, torch.sparse_bsr)
            else (tensor.ccol_indices(), tensor.row_indices())
        )
        parts = [compressed, plain, tensor.values()]
        options = {"layout": layout}
    stand_ins = [upload_to(channel, part) for part in parts]
    options.update(dtype=tensor.dtype, device=channel.device)
    result: ProxyTensor = forward(_SPARSE_FACTORIES[layout], (*stand_ins, list(tensor.shape)), options)
    return result


def _checked_sparse_coo(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`_sparse_coo_tensor_with_dims_and_tensors`, which `torch.sparse_coo_tensor` and sparse
    gradients (`nn.Embedding(sparse=True)`) build with: the server refuses it, since it checks
    nothing against memory, so the checked constructor makes the tensor from the same parts."""
    size, indices, values = args[2], args[3], args[4]
    options = {
        "dtype": kwargs.get("dtype") or values.dtype,
        "device": values.device,
        "is_coalesced": kwargs.get("is_coalesced"),
    }
    return forward(_SPARSE_FACTORIES[torch.sparse_coo], (indices, values, list(size)), options)


def _checked_sparse_compressed(layout: Any) -> SpecialHandler:
    """The unchecked constructor of a compressed sparse layout (what `torch.sparse_csr_tensor` and
    the like build with), run as the checked one, as `_checked_sparse_coo`."""

    def construct(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        compressed, plain, values, size = args[:4]
        options = {
            "dtype": kwargs.get("dtype") or values.dtype,
            "layout": kwargs.get("layout") or layout,
            "device": values.device,
        }
        factory = _SPARSE_FACTORIES[options["layout"]]
        return forward(factory, (compressed, plain, values, list(size)), options)

    return construct


SPARSE_OPS: dict[Any, SpecialHandler] = {
    torch.ops.prim.layout.default: _layout_of,
    torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors.default: _checked_sparse_coo,
    torch.ops.aten._sparse_compressed_tensor_unsafe.default: _checked_sparse_compressed(None),
    **{
        getattr(
            torch.ops.aten, f"_sparse_{str(layout).removeprefix('torch.sparse_')}_tensor_unsafe"
        ).default: (_checked_sparse_compressed(layout))
        for layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
    },
}
"""The client's handlers of sparse operators: layouts, and constructors run as checked ones."""


def install() -> None:
    """Give tensor.py its sparse stand-ins and the dispatch its sparse handlers."""
    stand_ins.new_sparse_stand_in = new_sparse_stand_in
    stand_ins.upload_sparse = upload_sparse
    stand_ins.sparse_from_parts = sparse_from_parts
    stand_ins.special_ops.update(SPARSE_OPS)
