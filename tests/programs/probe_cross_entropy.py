"""`F.cross_entropy` in its forms (class weights, label smoothing, ignored targets, every
reduction, segmentation maps, soft targets), loss and input gradient printed as digests of
their bytes, so one differing bit shows (weighted, smoothed means differed in the gradient)."""

import hashlib
import sys

import torch
from torch.nn import functional as F

device = sys.argv[1]


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


torch.manual_seed(0)
logits = torch.randn(6, 5, device=device)
targets = torch.tensor([0, 4, -100, 2, 1, -100], device=device)
weight = torch.rand(5, device=device)
maps = torch.randn(2, 5, 3, 4, device=device)
map_targets = torch.randint(0, 5, (2, 3, 4), device=device)
map_targets[0, 1] = 7
smoothed = {"weight": weight, "label_smoothing": 0.1}
cases = {
    "weighted smoothed mean": (logits, targets, smoothed),
    "weighted smoothed sum": (logits, targets, {**smoothed, "reduction": "sum"}),
    "weighted smoothed none": (logits, targets, {**smoothed, "reduction": "none"}),
    "smoothed mean": (logits, targets, {"label_smoothing": 0.1}),
    "weighted mean": (logits, targets, {"weight": weight}),
    "map weighted smoothed": (maps, map_targets, {**smoothed, "ignore_index": 7}),
    "soft targets": (logits, logits.softmax(1), smoothed),
    "host weighted smoothed": (logits.cpu(), targets.cpu(), {"weight": weight.cpu(), "label_smoothing": 0.1}),
}
for name, (inputs, wanted, options) in cases.items():
    leaf = inputs.detach().requires_grad_()
    loss = F.cross_entropy(leaf, wanted, **options)
    loss.sum().backward()
    print(name, digest(loss), digest(leaf.grad))
