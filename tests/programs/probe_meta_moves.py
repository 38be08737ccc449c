"""Tensors moved to the meta device (`Module.to("meta")`, accelerate's offloading and
`init_empty_weights`) and parameters re-wrapped by their type (accelerate's
`set_module_tensor_to_device`): layouts, gradients and values printed."""

import sys

import torch
from accelerate.utils import set_module_tensor_to_device

device = sys.argv[1]
x = torch.arange(6.0, device=device).reshape(2, 3)
moves = {
    "to meta": lambda: x.to("meta"),
    "half": lambda: x.to(device="meta", dtype=torch.float16),
    "transposed": lambda: x.t().to("meta"),
    "channels last": lambda: x.reshape(1, 1, 2, 3).to("meta", memory_format=torch.channels_last),
    "with gradient": lambda: x.clone().requires_grad_().to("meta"),
}
for name, move in moves.items():
    y = move()
    print(name, y.device, y.dtype, tuple(y.shape), y.stride(), y.requires_grad, y.grad_fn is not None)
torch.manual_seed(0)
module = torch.nn.Linear(3, 2).to(device).to("meta")
print("module", module.weight.device, isinstance(module.weight, torch.nn.Parameter))
linear = torch.nn.Linear(3, 2).to(device)
set_module_tensor_to_device(linear, "bias", "meta")
print("offloaded", linear.bias.device, isinstance(linear.bias, torch.nn.Parameter))
set_module_tensor_to_device(linear, "bias", device, value=torch.tensor([0.5, -0.5]))
set_module_tensor_to_device(linear, "weight", device, value=torch.ones(2, 3))
print("loaded", linear.bias.device == x.device, linear.bias.requires_grad, linear(x).tolist())
