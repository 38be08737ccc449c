"""`tensor.data = other` (old-style weight initialisation, weight surgery): the tensor takes the
other's shape and values, keeps them once the other is gone, and trains on from them."""

import gc
import sys

import torch
from torch import nn

device = sys.argv[1]
torch.manual_seed(0)
parameter = nn.Parameter(torch.zeros(2, device=device))
parameter.data = torch.ones(4, device=device)
print("parameter", tuple(parameter.shape), parameter.sum().item(), parameter.tolist())
plain = torch.zeros(3, device=device)
plain.data = torch.arange(3.0, device=device)
gc.collect()
print("plain", plain.tolist(), (plain + 1).tolist())
layer = nn.Linear(3, 2).to(device)
layer.weight.data = torch.randn(3, 2, device=device).t().contiguous()
layer.bias.data = layer.bias.data * 0 + 0.5
optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
for step in range(3):
    optimizer.zero_grad()
    loss = layer(torch.ones(4, 3, device=device)).pow(2).sum()
    loss.backward()
    optimizer.step()
    print("step", step, loss.item(), layer.weight.grad.tolist())
print("trained", layer.weight.tolist(), layer.bias.tolist())
view = layer.weight[0]
view.data = torch.full((5,), 7.0, device=device)
print("view", view.tolist(), layer.weight.tolist())
