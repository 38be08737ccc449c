"""Tensors made like a device tensor but asked for on the host land on the host, with the values a
direct run gets; torch.nn.init.trunc_normal_ (which does `new_tensor(..., device="cpu")`) works."""

import sys

import torch

device = sys.argv[1]
torch.manual_seed(7)
x = torch.arange(6, dtype=torch.float64, device=device).reshape(2, 3)
made = {
    "new_tensor": x.new_tensor([1.5, 2.5], device="cpu"),
    "new_tensor of x": x.new_tensor(x, device="cpu"),
    "new_empty": x.new_empty(2, device="cpu").fill_(3),
    "new_zeros": x.new_zeros(2, device=torch.device("cpu")),
    "new_ones": x.new_ones((2, 2), device="cpu"),
    "new_full": x.new_full((2,), 4.0, device="cpu"),
    "zeros_like": torch.zeros_like(x, device="cpu"),
    "ones_like": torch.ones_like(x, device="cpu"),
    "full_like": torch.full_like(x, 2.0, device="cpu"),
    "empty_like": torch.empty_like(x, device="cpu").fill_(1),
    "rand_like": torch.rand_like(x, device="cpu"),
    "randn_like": torch.randn_like(x, device="cpu"),
    "randint_like": torch.randint_like(x, 10, device="cpu"),
    "new_zeros on the device": x.new_zeros(2),
}
for name, tensor in made.items():
    print(name, tensor.device.type, tensor.dtype, tensor.shape, tensor.cpu().tolist())
weight = torch.empty(4, 4, device=device)
torch.nn.init.trunc_normal_(weight, std=0.02)
print("trunc_normal_", weight.device.type, weight.cpu().sum().item())
