"""Layers whose CUDA path differs under `torch.use_deterministic_algorithms(True)` (replicate
padding, bilinear and trilinear upsampling, 3-d max pooling with indices), forward and backward,
printed as digests of their bytes so that one differing bit shows."""

import hashlib
import os
import sys

import torch
from torch import nn
from torch.nn import functional as F

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
device = sys.argv[1]
torch.use_deterministic_algorithms(True)


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def report(name: str, output: torch.Tensor, leaf: torch.Tensor) -> None:
    leaf.grad = None
    output.square().sum().backward()
    print(name, tuple(output.shape), digest(output), digest(leaf.grad))


torch.manual_seed(0)
image = torch.randn(2, 3, 9, 7, device=device, requires_grad=True)
volume = torch.randn(1, 2, 5, 6, 7, device=device, requires_grad=True)
conv = nn.Conv2d(3, 4, 3, padding=2, padding_mode="replicate").to(device)
report("conv replicate", conv(image), image)
report("pad replicate 2d", F.pad(image, (1, 2, 3, 0), mode="replicate"), image)
report("pad replicate 3d", nn.ReplicationPad3d(1)(volume), volume)
for align in (False, True):
    upsampled = F.interpolate(image, scale_factor=1.7, mode="bilinear", align_corners=align)
    report(f"bilinear {align}", upsampled, image)
    upsampled = F.interpolate(volume, size=(7, 8, 9), mode="trilinear", align_corners=align)
    report(f"trilinear {align}", upsampled, volume)
report("upsample module", nn.Upsample(scale_factor=2, mode="bilinear")(image), image)
pooled, indices = F.max_pool3d(volume, 2, return_indices=True)
print("pool indices", digest(indices), indices.device.type == device)
report("max_pool3d", pooled, volume)
print("conv grad", digest(conv.weight.grad))
