"""Which operators the server runs for a job: aten and prims tensor operators, by allowlist, and
the proxy's own (encoder_operator.py).

A job names the operators it wants (OP_DEFINE); the server resolves a name only through
`resolve`, which serves an operator when all of these hold:
- its namespace is in SERVED_NAMESPACES;
- it is registered with torch's dispatcher (TorchScript-only builtins such as
  `aten::save(t item, str filename)` or `aten::warn` are not);
- it is not in REFUSED;
- if it takes a string argument, it is in STRING_ARGUMENTS (the string is a mode, a name or
  an equation, never a path);
- if it takes no tensor and returns none, it is in NO_TENSOR_OPERATORS (a pure query);
- if its name says "unsafe", it is in UNSAFE_NAMES_CHECKED (its checks were verified).
Everything else is refused by name with the reason, raised in the job as PermissionError.
Collectives are not operator calls: a job asks for one with OP_COLLECTIVE naming its c10d
operator, and the server runs those in COLLECTIVES (`collective_kind`), with the other members
of the process group (collectives.py); a c10d operator named in OP_DEFINE is refused.
The last three rules refuse by default what torch adds in a new release; the test
`tests/proxy/test_operators.py` fails until each new such operator is classified here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from singularity.proxy.bootstrap._singularity_proxy import encoder_operator, protocol

SERVED_NAMESPACES = frozenset(protocol.SERVED_NAMESPACES)
"""Namespaces of the tensor operators the server runs: torch's and the proxy's own."""
encoder_operator.define()

COLLECTIVE_NAMESPACES = frozenset({"c10d"})
"""Namespaces of the collective operators the server carries out (see COLLECTIVES)."""

COLLECTIVES: dict[str, str] = {
    "c10d::allreduce_": "allreduce",
    "c10d::allreduce_coalesced_": "allreduce",
    "c10d::broadcast_": "broadcast",
    "c10d::allgather_": "allgather",
    "c10d::_allgather_base_": "allgather_into_tensor",
    "c10d::allgather_into_tensor_coalesced_": "allgather_into_tensor",
    "c10d::gather_": "gather",
    "c10d::scatter_": "scatter",
    "c10d::reduce_scatter_": "reduce_scatter",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d::reduce_": "reduce",
    "c10d::alltoall_": "alltoall",
    "c10d::alltoall_base_": "alltoall",
    "c10d::barrier": "barrier",
}
"""The collective operators the server carries out for a job (OP_COLLECTIVE), and the kind of
collective each is (collective_kinds.py). The job's client turns torch's other ways of asking for
these (`_c10d_functional`, the process-group methods) into them."""

COLLECTIVES_REFUSED: dict[str, str] = {
    "c10d::send": "point-to-point operations are not served on proxied devices",
    "c10d::recv_": "point-to-point operations are not served on proxied devices",
    "c10d::recv_any_source_": "point-to-point operations are not served on proxied devices",
    "c10d::monitored_barrier_": "it is a gloo (host) barrier",
    "c10d::allgather_coalesced_": "it is deprecated in torch (use allgather_into_tensor_coalesced)",
    "c10d::check_for_nan": "it is not a collective",
}
"""c10d operators the server does not carry out, with the reason the job is told."""

_FILES = "it reads or writes files on the server"
_PROCESS = "it changes state the whole server process shares"
_UNCHECKED = "it builds tensors whose indices or sizes are not checked against their memory"
_TESTING = "it exists only to test torch itself"

REFUSED: dict[str, str] = {
    "aten::from_file": _FILES,
    "aten::_print": "it writes to the server's output",
    "aten::_cufft_set_plan_cache_max_size": _PROCESS,
    "aten::_cufft_clear_plan_cache": _PROCESS,
    "aten::_reshape_alias": _UNCHECKED,
    "aten::_reshape_alias_copy": _UNCHECKED,
    "aten::_sparse_coo_tensor_unsafe": _UNCHECKED,
    "aten::_sparse_coo_tensor_with_dims": _UNCHECKED,
    "aten::_sparse_coo_tensor_with_dims_and_tensors": _UNCHECKED,
    "aten::_sparse_compressed_tensor_unsafe": _UNCHECKED,
    "aten::_sparse_compressed_tensor_with_dims": _UNCHECKED,
    "aten::_sparse_csr_tensor_unsafe": _UNCHECKED,
    "aten::_sparse_csc_tensor_unsafe": _UNCHECKED,
    "aten::_sparse_bsr_tensor_unsafe": _UNCHECKED,
    "aten::_sparse_bsc_tensor_unsafe": _UNCHECKED,
    "aten::_nested_view_from_buffer": _UNCHECKED,
    "aten::_nested_view_from_buffer_copy": _UNCHECKED,
    "aten::_nested_view_from_jagged": _UNCHECKED,
    "aten::_nested_view_from_jagged_copy": _UNCHECKED,
    "aten::_test_ambiguous_defaults": _TESTING,
    "aten::_test_string_default": _TESTING,
}
"""Operators never served, with the reason the job is told."""

STRING_ARGUMENTS = frozenset(
    {
        "aten::_assert_async",  # message
        "aten::_assert_scalar",
        "aten::_functional_assert_async",
        "aten::_functional_assert_scalar",
        "aten::_convolution_mode",  # padding mode
        "aten::conv1d",
        "aten::conv2d",
        "aten::conv3d",
        "aten::_linalg_check_errors",  # the name of the calling API
        "aten::_linalg_eigh",  # UPLO
        "aten::_linalg_svd",  # driver
        "aten::linalg_eigh",
        "aten::linalg_eigvalsh",
        "aten::linalg_svd",
        "aten::linalg_svdvals",
        "aten::linalg_qr",  # mode
        "aten::linalg_lstsq",  # driver
        "aten::linalg_cond",  # ord
        "aten::linalg_matrix_norm",
        "aten::linalg_norm",
        "aten::_mixed_dtypes_linear",  # activation
        "aten::_sparse_semi_structured_linear",
        "aten::_sparse_semi_structured_tile",  # algorithm
        "aten::_segment_reduce_backward",  # reduce
        "aten::segment_reduce",
        "aten::_sparse_mm",
        "aten::_sparse_mm_reduce_impl",
        "aten::_sparse_mm_reduce_impl_backward",
        "aten::index_reduce",
        "aten::index_reduce_",
        "aten::scatter",
        "aten::scatter_",
        "aten::scatter_reduce",
        "aten::scatter_reduce_",
        "aten::div",  # rounding_mode
        "aten::div_",
        "aten::divide",
        "aten::divide_",
        "aten::einsum",  # equation
        "aten::fft_fft",  # norm
        "aten::fft_fft2",
        "aten::fft_fftn",
        "aten::fft_hfft",
        "aten::fft_hfft2",
        "aten::fft_hfftn",
        "aten::fft_ifft",
        "aten::fft_ifft2",
        "aten::fft_ifftn",
        "aten::fft_ihfft",
        "aten::fft_ihfft2",
        "aten::fft_ihfftn",
        "aten::fft_irfft",
        "aten::fft_irfft2",
        "aten::fft_irfftn",
        "aten::fft_rfft",
        "aten::fft_rfft2",
        "aten::fft_rfftn",
        "aten::stft",  # pad_mode
        "aten::gelu",  # approximate
        "aten::gelu_",
        "aten::gelu_backward",
        "aten::meshgrid",  # indexing
        "aten::quantile",  # interpolation
        "aten::nanquantile",
        "aten::pad",  # mode
        "aten::pad_sequence",  # padding_side
        "aten::searchsorted",  # side
    }
)
"""Operators whose string arguments are modes, names or equations: served."""

NO_TENSOR_OPERATORS = frozenset(
    {
        "aten::_assert_scalar",
        "aten::_cufft_get_plan_cache_max_size",
        "aten::_cufft_get_plan_cache_size",
        "aten::_nnpack_available",
        "aten::_use_cudnn_rnn_flatten_weight",
        "aten::can_cast",
        "aten::is_vulkan_available",
        "aten::promote_types",
        "aten::result_type",
        "aten::sym_constrain_range",
        "aten::sym_constrain_range_for_size",
        "prims::maximum_value",
        "prims::minimum_value",
    }
)
"""Operators that take and return no tensor but only answer a question: served."""

UNSAFE_NAMES_CHECKED = frozenset(
    {
        "aten::_unsafe_view",  # checks the size like view
        "aten::unsafe_chunk",  # "unsafe" for autograd only
        "aten::unsafe_split",
        "aten::unsafe_split_with_sizes",
        "aten::_unsafe_index",  # checks its indices in eager mode
        "aten::_unsafe_index_put",
        "aten::_unsafe_masked_index",  # clamps its indices
        "aten::_unsafe_masked_index_put_accumulate",
    }
)
"""Operators named "unsafe" whose eager kernels check their memory accesses: served."""


class RefusedOperator(PermissionError):
    """The server does not run this operator for jobs."""


@functools.cache
def _dispatcher_operators() -> frozenset[str]:
    """Every operator registered with torch's dispatcher, as 'namespace::name.overload'."""
    return frozenset(torch._C._dispatch_get_all_op_names())


def refusal(namespace: str, name: str, overload: str) -> str:
    """Why the operator namespace::name.overload is not served ('' when it is)."""
    base = f"{namespace}::{name}"
    if namespace in COLLECTIVE_NAMESPACES:
        return "collectives are carried out as collective operations, not called as operators"
    if namespace not in SERVED_NAMESPACES:
        return f"operators of the {namespace!r} namespace are not served"
    full = f"{base}.{overload}" if overload != "default" else base
    if full not in _dispatcher_operators():
        return "it is not a dispatcher operator"
    if base in REFUSED:
        return REFUSED[base]
    schema = torch._C._get_schema(base, "" if overload == "default" else overload)
    return schema_refusal(base, schema)


def schema_refusal(base: str, schema: Any) -> str:
    """Why an operator with this schema is refused by default ('' when it is served)."""
    arguments = [str(argument.type) for argument in schema.arguments]
    if any("str" in kind for kind in arguments) and base not in STRING_ARGUMENTS:
        return "it takes a string the server has not been told is safe (a path, perhaps)"
    returns = [str(result.type) for result in schema.returns]
    if not any("Tensor" in kind for kind in arguments + returns) and base not in NO_TENSOR_OPERATORS:
        return "it does not operate on tensors"
    if "unsafe" in base and base not in UNSAFE_NAMES_CHECKED:
        return "its name says it does not check its inputs"
    return ""


def resolve(namespace: str, name: str, overload: str) -> Any:
    """The operator (OpOverload) namespace::name.overload if it is served; RefusedOperator if not."""
    reason = refusal(namespace, name, overload)
    if reason:
        raise RefusedOperator(
            f"proxy: {namespace}::{name}.{overload} is not run on proxied devices: {reason}"
        )
    operator = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    full = f"{namespace}::{name}" + (f".{overload}" if overload != "default" else "")
    if not isinstance(operator, torch._ops.OpOverload) or operator._name != full:
        raise RefusedOperator(f"proxy: {full} does not name one operator")
    return operator


def collective_kind(operator: str) -> str:
    """The kind of collective a served c10d operator ('c10d::allreduce_') is; else RefusedOperator."""
    kind = COLLECTIVES.get(operator)
    if kind is not None:
        return kind
    reason = COLLECTIVES_REFUSED.get(operator, "it is not a collective the server carries out")
    raise RefusedOperator(f"proxy: {operator} is not run on proxied devices: {reason}")


@dataclass(frozen=True)
class Served:
    """A served operator and what the executor must check around it."""

    operator: Any
    size_argument: int | None
    """Position of a `size` argument that sets how much the operator allocates (None: none)."""
    grows_inputs: bool
    """Whether it may enlarge a tensor it was given (out= arguments, resize_, set_)."""
    reshapes_input: bool
    """Whether it changes the shape, stride or offset of a tensor it was given (an in-place view)."""
    rebinds_input: bool
    """Whether it may give a tensor it was given another storage (set_)."""
    resizes_outputs: bool
    """Whether it writes `out=` arguments, which it resizes when their shape is not the result's."""
    touches_elements: bool
    """Whether it may read or write its tensors' elements (views and in-place view changes do not:
    FSDP1 views and re-points parameters whose storage it freed)."""


def serve(namespace: str, name: str, overload: str) -> Served:
    """The operator with its checks, if it is served; RefusedOperator if not."""
    operator = resolve(namespace, name, overload)
    arguments = operator._schema.arguments
    size_argument = next(
        (i for i, a in enumerate(arguments) if a.name == "size" and str(a.type) == "List[int]"), None
    )
    written = [a for a in arguments if a.alias_info is not None and a.alias_info.is_write]
    grows = bool(written) and (name in ("resize_", "resize_as_", "set_") or any(a.is_out for a in written))
    reshapes = torch.Tag.inplace_view in operator.tags
    resizes_outputs = any(a.is_out for a in written)
    touches_elements = not (operator.is_view or reshapes)
    return Served(operator, size_argument, grows, reshapes, name == "set_", resizes_outputs, touches_elements)
