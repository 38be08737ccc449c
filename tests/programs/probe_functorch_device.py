"""Tensors made on `t.device` inside torch.func's transforms (`vmap`, `grad`, `jacrev`), the usual
way to make a constant beside an input. Run with `cpu` or `cuda`: both must print the same."""

import sys

import torch

device = sys.argv[1]
x = torch.arange(6.0).reshape(2, 3).to(device)


def shifted(t: torch.Tensor) -> torch.Tensor:
    assert t.is_cuda == (device == "cuda") and t.device.type == device
    return t * t + torch.ones(3, device=t.device)


print("vmap", torch.vmap(shifted)(x).tolist())
print("grad", torch.func.grad(lambda t: shifted(t).sum())(x[1]).tolist())
print("jacrev", torch.func.jacrev(shifted)(x[0]).tolist())
