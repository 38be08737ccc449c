"""Foreach updates given their per-tensor scalars as a host tensor (CUDA's kernels read them on
the host, so a GPU takes them so), a host tensor in a tensor list, which CUDA refuses, and
`_foreach_copy_` between host and device lists, which CUDA copies pair by pair."""

import sys

import torch

device = sys.argv[1]
torch.manual_seed(0)
a = [torch.randn(3, device=device), torch.randn(5, device=device)]
b = [torch.randn(3, device=device), torch.randn(5, device=device)]
c = [torch.rand(3, device=device) + 1, torch.rand(5, device=device) + 1]
steps = torch.tensor([0.1, 0.2])
torch._foreach_addcdiv_(a, b, c, steps)
print("addcdiv_", [t.tolist() for t in a])
print("addcmul", [t.tolist() for t in torch._foreach_addcmul(a, b, c, steps)])
if device == "cuda":
    try:
        torch._foreach_addcmul_(a, [b[0], b[1].cpu()], c, steps)
    except RuntimeError as error:
        print("mixed", str(error).split(",")[0])
else:
    print("mixed Expected all tensors to be on the same device")
stored = [torch.zeros(3), torch.zeros(5)]
torch._foreach_copy_(stored, a)
torch._foreach_copy_(b, stored)
print("copies", [t.tolist() for t in stored], [t.tolist() for t in b])
