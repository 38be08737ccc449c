"""Operators of a library registered as C++ extensions register theirs (torchvision's nms and
roi_align): a schema and a CPU kernel per operator, an autograd formula for some. On a device
they run as they would on the CPU: values, data-dependent shapes, in-place updates, gradients."""

import sys

import torch

device = sys.argv[1]
library = torch.library.Library("probe_extension", "DEF")
library.define("scale(Tensor x, float factor) -> Tensor")
library.define("keep_above(Tensor scores, float threshold) -> Tensor")
library.define("bump_(Tensor(a!) x) -> Tensor(a!)")
library.define("split_sign(Tensor x) -> (Tensor, Tensor)")
library.impl("scale", lambda x, factor: x * factor, "CPU")
library.impl("keep_above", lambda scores, threshold: torch.nonzero(scores > threshold).flatten(), "CPU")
library.impl("bump_", lambda x: x.add_(1), "CPU")
library.impl("split_sign", lambda x: (x.clamp(min=0), x.clamp(max=0)), "CPU")


def backward(ctx, grad):
    return grad * ctx.factor, None


def setup_context(ctx, inputs, output):
    ctx.factor = inputs[1]


torch.library.register_autograd("probe_extension::scale", backward, setup_context=setup_context)
ops = torch.ops.probe_extension
torch.manual_seed(0)
x = torch.randn(6, device=device)
print("scale", ops.scale(x, 2.5).tolist())
kept = ops.keep_above(x, 0.0)
print("keep_above", kept.tolist(), kept.device == x.device)
y = x.clone()
out = ops.bump_(y)
print("bump_", y.tolist(), out is y)
positive, negative = ops.split_sign(x)
print("split_sign", positive.tolist(), negative.tolist(), negative.device == x.device)
weight = torch.ones(6, device=device, requires_grad=True)
ops.scale(x * weight, 3.0).sum().backward()
print("grad", weight.grad.tolist())
