# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""The server's operator for `nn.TransformerEncoder`'s nested fast path, run in one call.

In eval mode without gradients, with a padding mask, `nn.TransformerEncoder` packs its batch
into a nested tensor (`torch._nested_tensor_from_mask`), runs each layer's fused kernel on it
(`torch._transformer_encoder_layer_fwd`) and pads the result again (`to_padded_tensor`), so
padded positions come out as zeros and the kernels are those of the nested layout. Nested
tensors have no shape a stand-in could carry, so the client collects that chain (fast_paths.py)
and the server runs it whole by this operator: the same kernels in the same order as a direct
run. Both sides define it (it imports nothing but torch); its namespace is served.
"""

from __future__ import annotations

from typing import Any

import torch

NAMESPACE = "singularity_proxy"
LAYER_TENSORS = 12
"""Tensors of one layer's call, in `_transformer_encoder_layer_fwd`'s order (qkv to ffn)."""
LAYER_OPTIONS = 4
"""Integers of one layer's call: embed_dim, num_heads, use_gelu, norm_first."""

_SCHEMA = (
    "padded_encoder(Tensor src, Tensor keep, bool mask_check, Tensor[] weights, int[] options, "
    "float[] eps, float padding, SymInt[]? output_size) -> Tensor"
)
_library: list[Any] = []


def _padded_encoder(
    src: torch.Tensor,
    keep: torch.Tensor,
    mask_check: bool,
    weights: list[torch.Tensor],
    options: list[int],
    eps: list[float],
    padding: float,
    output_size: list[int] | None,
) -> torch.Tensor:
    """Pack `src` by `keep`, run each layer's fused kernel on the nested tensor, pad the result."""
    nested = torch._nested_tensor_from_mask(src, keep, mask_check=mask_check)
    for layer, layer_eps in enumerate(eps):
        qkv_w, qkv_b, proj_w, proj_b, n1_w, n1_b, n2_w, n2_b, f1_w, f1_b, f2_w, f2_b = weights[
            layer * LAYER_TENSORS : (layer + 1) * LAYER_TENSORS
        ]
        first = layer * LAYER_OPTIONS
        embed_dim, num_heads, use_gelu, norm_first = options[first : first + LAYER_OPTIONS]
        nested = torch._transformer_encoder_layer_fwd(
            nested,
            embed_dim,
            num_heads,
            qkv_w,
            qkv_b,
            proj_w,
            proj_b,
            bool(use_gelu),
            bool(norm_first),
            layer_eps,
            n1_w,
            n1_b,
            n2_w,
            n2_b,
            f1_w,
            f1_b,
            f2_w,
            f2_b,
            None,
            None,
        )
    return nested.to_padded_tensor(padding, output_size)


def define() -> Any:
    """The operator (defined in this process on first use)."""
    if not _library:
        library = torch.library.Library(NAMESPACE, "FRAGMENT")
        library.define(_SCHEMA)
        library.impl("padded_encoder", _padded_encoder, "CPU")
        _library.append(library)
    return torch.ops.singularity_proxy.padded_encoder.default
