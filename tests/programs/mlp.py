"""MLP regression with Adam; device chosen the usual way."""

import sys

import torch
from _common import checksum
from torch import nn

device = "cuda" if torch.cuda.is_available() else "cpu"
print(f"using {device}", file=sys.stderr)
torch.manual_seed(0)

x = torch.randn(256, 32)
w = torch.randn(32, 1)
y = torch.sin(x @ w) + 0.1 * torch.randn(256, 1)
x, y = x.to(device), y.to(device)

model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
model = model.to(device)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
loss_fn = nn.MSELoss()
for step in range(40):
    idx = torch.arange(step * 16 % 256, step * 16 % 256 + 16)
    pred = model(x[idx.to(device)])
    loss = loss_fn(pred, y[idx.to(device)])
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 4 == 0:
        print(f"step {step} loss {loss.item():.8f}")
print("final", checksum(model))
