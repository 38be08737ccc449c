"""The operator allowlist: every risky kind of operator torch has is classified, and refusals hold.

These tests read torch's dispatcher registry, so they fail when a new torch brings an
operator that takes a string, touches no tensor or calls itself unsafe and that
proxy/server/operators.py neither serves explicitly nor refuses.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from singularity.proxy.server import operators


def _served_schemas() -> dict[str, list[Any]]:
    """Schemas of the dispatcher operators in the served namespaces, by 'namespace::name'."""
    found: dict[str, list[Any]] = {}
    for full in operators._dispatcher_operators():
        namespace, rest = full.split("::", 1)
        if namespace not in operators.SERVED_NAMESPACES:
            continue
        name, _, overload = rest.partition(".")
        found.setdefault(f"{namespace}::{name}", []).append(
            torch._C._get_schema(f"{namespace}::{name}", overload)
        )
    return found


def _classified() -> set[str]:
    return (
        set(operators.REFUSED)
        | operators.STRING_ARGUMENTS
        | operators.NO_TENSOR_OPERATORS
        | operators.UNSAFE_NAMES_CHECKED
    )


def test_every_risky_operator_is_classified() -> None:
    unclassified = []
    for base, schemas in _served_schemas().items():
        for schema in schemas:
            arguments = [str(a.type) for a in schema.arguments]
            results = [str(r.type) for r in schema.returns]
            takes_string = any("str" in kind for kind in arguments)
            no_tensor = not any("Tensor" in kind for kind in arguments + results)
            if (takes_string or no_tensor or "unsafe" in base) and base not in _classified():
                unclassified.append(str(schema))
    assert not unclassified, "classify these in proxy/server/operators.py:\n" + "\n".join(
        sorted(unclassified)
    )


def test_lists_name_existing_operators() -> None:
    existing = set(_served_schemas())
    stale = sorted(_classified() - existing)
    assert not stale, f"no longer in torch, remove from proxy/server/operators.py: {stale}"


@pytest.mark.parametrize(
    ("namespace", "name", "overload", "reason"),
    [
        ("aten", "from_file", "default", "files"),
        ("aten", "from_file", "out", "files"),
        ("aten", "_print", "default", "output"),
        ("aten", "save", "default", "not a dispatcher operator"),  # TorchScript's file writer
        ("aten", "warn", "default", "not a dispatcher operator"),
        ("aten", "_sparse_coo_tensor_unsafe", "default", "not checked"),
        ("aten", "_reshape_alias", "default", "not checked"),
        ("aten", "_cufft_set_plan_cache_max_size", "default", "whole server process"),
        ("c10d", "allreduce_", "default", "carried out as collective operations"),
        ("mkldnn", "_linear_pointwise", "default", "'mkldnn' namespace"),
        ("os", "system", "default", "'os' namespace"),
        ("aten", "add", "no_such_overload", "not a dispatcher operator"),
        ("aten", "__class__", "default", "not a dispatcher operator"),
    ],
)
def test_refused_by_name_with_reason(namespace: str, name: str, overload: str, reason: str) -> None:
    with pytest.raises(operators.RefusedOperator, match=reason) as refused:
        operators.resolve(namespace, name, overload)
    assert isinstance(refused.value, PermissionError)
    assert f"{namespace}::{name}.{overload} is not run on proxied devices" in str(refused.value)


def test_refuses_new_string_operators_by_default() -> None:
    schema = torch._C._get_schema("aten::from_file", "")
    assert "string" in operators.schema_refusal("aten::read_anything", schema)
    assert operators.schema_refusal("aten::einsum", torch._C._get_schema("aten::einsum", "")) == ""


@pytest.mark.parametrize(
    ("namespace", "name", "overload"),
    [
        ("aten", "add", "Tensor"),
        ("aten", "_unsafe_view", "default"),
        ("aten", "unsafe_split", "Tensor"),
        ("aten", "mkldnn_rnn_layer", "default"),
        ("aten", "einsum", "default"),
        ("aten", "div", "Tensor_mode"),
        ("aten", "_local_scalar_dense", "default"),
        ("prims", "add", "default"),
    ],
)
def test_tensor_operators_are_served(namespace: str, name: str, overload: str) -> None:
    operator = operators.resolve(namespace, name, overload)
    assert operator is getattr(getattr(getattr(torch.ops, namespace), name), overload)
