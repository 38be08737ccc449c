"""A longer MLP run with a value read every step and bursts of asynchronous work between.

With --hold FILE it waits, before its final line, until FILE exists (a test's signal to end).
"""

import argparse
import os
import time

import torch
from _common import checksum
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=60)
ap.add_argument("--width", type=int, default=256)
ap.add_argument("--hold", help="before the final line, wait until this file exists")
args = ap.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(10)
w = args.width
model = nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 1))
model.to(device)
opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
x = torch.randn(512, w).to(device)
y = x[:, :8].sum(dim=1, keepdim=True)
for step in range(args.steps):
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 5 == 4:
        acc = torch.zeros(w, w, device=device)
        for _ in range(30):
            acc = acc + torch.tanh(x.t() @ x / 512)
        print(f"step {step} loss {loss.item():.8f} burst {acc.mean().item():.6f}", flush=True)
    else:
        print(f"step {step} loss {loss.item():.8f}", flush=True)
while args.hold and not os.path.exists(args.hold):
    time.sleep(0.05)
print("final", checksum(model), flush=True)
