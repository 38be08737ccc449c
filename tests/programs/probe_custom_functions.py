"""Custom autograd Functions with several outputs, some of them unused (a kernel's wrapper that
also returns a statistic): backward gets zeros for the unused ones, on their device, as on a GPU;
gradcheck, which feeds undefined gradients on purpose, passes."""

import sys

import torch

device = sys.argv[1]


class TwoOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return a * 2, a * 3

    @staticmethod
    def backward(ctx, first, second):
        print("  backward gets", first.device == second.device, second.tolist())
        return first * 2 + second * 3


class WithCount(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a.exp(), int(a.numel())

    @staticmethod
    def backward(ctx, grad, _count):
        return grad * 2


class Exp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, k):
        ctx.save_for_backward(a)
        ctx.k = k
        return a.exp() * k

    @staticmethod
    def backward(ctx, grad):
        (a,) = ctx.saved_tensors
        return grad * a.exp() * ctx.k, None


a = torch.tensor([1.0, 2.0], device=device, requires_grad=True)
first, second = TwoOutputs.apply(a)
first.sum().backward()
print("first used", a.grad.tolist())
a.grad = None
first, second = TwoOutputs.apply(a)
(second * 5).sum().backward()
print("second used", a.grad.tolist())
a.grad = None
out, count = WithCount.apply(a)
out.sum().backward()
print("with a count", count, a.grad.tolist())
b = torch.tensor([0.5, 1.0], dtype=torch.double, device=device, requires_grad=True)
print("gradcheck", torch.autograd.gradcheck(Exp.apply, (b, 2.0)))
