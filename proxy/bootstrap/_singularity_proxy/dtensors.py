# mypy: disable-error-code="no-untyped-call,unused-ignore"
"""DTensors whose parts are stand-ins: their device, their random operators, their shapes.

- **Device.** A DTensor is a wrapper whose C++ device is its local part's, the host for a
  stand-in; its `device` says `cuda:N`, as its part's does, so that torch's own checks
  (`value.device != mesh.device_type` in the state-dict helpers) and the program's see where it is.
- **Random operators.** On CUDA, DTensor moves the offsets of the device's Philox generator so
  that the ranks draw their parts of one global random tensor (`OffsetBasedRNGTracker`). A
  proxied device has no such generator: its numbers come from the job's CPU generator
  (randomness.py), whose state DTensor can neither read as (seed, offset) nor set through
  `torch.cuda`; its state sync would call `torch.cuda.get_rng_state().to("cuda")` inside
  DTensor's dispatch, where no torch-function mode sees it, and `fork_rng` would rewind the
  generator after every draw. So the tracker keeps no state, and its region only lends a user's
  generator to the draw: each rank draws its part from the job's generator, as DTensor does on
  the CPU with gloo.
- **Attention.** `scaled_dot_product_attention` picks its kernel by the C++ device, the host's
  for stand-ins: `_scaled_dot_product_flash_attention_for_cpu`, for which DTensor (written for
  CUDA's kernels) has no sharding strategy. It is given the strategies of CUDA's flash kernel:
  everything replicated, or sharded alike on the heads (tensor parallelism) or on the batch.
- **Shapes.** DTensor works out an operator's output shape by running it on fake tensors of the
  mesh's device type, where a CPU build of torch cannot run the decompositions of random
  operators on "cuda"; a proxied mesh's fake tensors are made on the host, where the proxy
  server computes anyway.

So pytorch/examples' FSDP2 example (`to_empty`, then `reset_parameters()`, then a full state
dict) runs, and draws what it draws on the CPU. torch.distributed.tensor takes most of a second
to import, so its modules are patched when the program imports them, not before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch

from .on_import import patch_modules
from .tensor import ProxyTensor


def install() -> None:
    """Patch DTensor's modules now if they are imported, else when they are."""
    patch_modules(PATCHES)


def patch_api(module: ModuleType) -> None:
    """Make a DTensor of stand-ins say it is on their device."""
    dtensor: Any = module.DTensor
    base_device = torch.Tensor.device.__get__  # type: ignore[attr-defined]

    def device(self: Any) -> torch.device:
        local = self._local_tensor
        return local.device if isinstance(local, ProxyTensor) else base_device(self)

    def is_cuda(self: Any) -> bool:
        return bool(device(self).type == "cuda")

    def get_device(self: Any) -> int:
        where = device(self)
        return -1 if where.type == "cpu" else (where.index or 0)

    dtensor.device = property(device)
    dtensor.is_cuda = property(is_cuda)
    dtensor.is_cpu = property(lambda self: device(self).type == "cpu")
    dtensor.get_device = get_device


def patch_random(module: ModuleType) -> None:
    """Make the module's `OffsetBasedRNGTracker` draw from the job's generator."""
    tracker: Any = module.OffsetBasedRNGTracker
    base: Any = module._RNGStateTracker
    resolve_device = module._resolve_device

    def __init__(self: Any, device_mesh: Any, run_state_sync: bool = True) -> None:
        base.__init__(self, resolve_device(device_mesh=device_mesh))

    tracker.__init__ = __init__
    tracker._distribute_region = _drawn_by_the_job


@contextlib.contextmanager
def _drawn_by_the_job(self: Any, spec: Any, generator: torch.Generator | None = None) -> Iterator[None]:
    """The region of one random operator on a DTensor: drawn from the job's generator, or from
    the user's (lent to the job's for the draw, and left advanced as if used directly)."""
    if generator is None:
        yield
        return
    own = torch.get_rng_state()
    torch.set_rng_state(generator.get_state())
    try:
        yield
    finally:
        generator.set_state(torch.get_rng_state())
        torch.set_rng_state(own)


def patch_op_schema(module: Any) -> None:
    """Make the fake tensors that DTensor's sharding propagation runs operators on host tensors
    when the mesh is the proxied devices'."""
    rebuild = module._rebuild_tensor_from_dtensor_meta

    def rebuild_on_host(spec: Any) -> object:
        if spec.mesh.device_type != "cuda" or spec.tensor_meta is None:
            return rebuild(spec)
        meta = spec.tensor_meta
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="cpu")

    module._rebuild_tensor_from_dtensor_meta = rebuild_on_host


def patch_package(module: ModuleType) -> None:
    """Give the host's flash attention kernels the sharding strategies of CUDA's, unless torch
    has its own."""
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy
    from torch.distributed.tensor.placement_types import Replicate, Shard

    aten = torch.ops.aten
    forward = aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    known = module.DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs

    def alike(placement: Any, tensors: int) -> list[Any]:
        return [placement] * tensors

    def strategy(outputs: int, inputs: int) -> Callable[[Any], Any]:
        def placements(op_schema: Any) -> Any:
            if op_schema.kwargs_schema.get("attn_mask") is not None:
                raise NotImplementedError(
                    "scaled_dot_product_attention with an attn_mask on DTensors of proxied devices"
                )
            mesh = op_schema.get_mesh_from_args(validate=False)
            each_dim = [alike(Replicate(), outputs + inputs), alike(Shard(1), outputs + inputs)]
            each_dim.append(alike(Shard(0), outputs + inputs))  # heads, then the batch
            return expand_to_full_mesh_op_strategy(mesh, op_schema, each_dim, input_index=outputs)

        return placements

    if forward not in known:
        register_op_strategy(forward, schema_info=RuntimeSchemaInfo(3))(strategy(2, 3))
    if backward not in known:
        register_op_strategy(backward, schema_info=RuntimeSchemaInfo(6))(strategy(3, 6))


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "torch.distributed.tensor": patch_package,
    "torch.distributed.tensor._api": patch_api,
    "torch.distributed.tensor._random": patch_random,
    "torch.distributed.tensor._op_schema": patch_op_schema,
}
"""DTensor's modules and what makes each fit proxied devices."""
