"""Holds a large tensor it only reads beside a small model it trains, a line per step.

For moves whose pre-copied device state the target preloads: the large tensor is pre-copied while
the job runs and never changes, the model changes every step. The last line sums the large tensor.
With --hold FILE it waits, before its final line, until FILE exists (a test's signal to end).
"""

import argparse
import os
import time

import torch
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--mib", type=int, default=64)
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("--hold", help="before the final line, wait until this file exists")
args = ap.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(3)
held = torch.randn(args.mib << 18).to(device)
model = nn.Linear(64, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
x = torch.randn(256, 64).to(device)
y = x[:, :4].sum(dim=1, keepdim=True)
for step in range(args.steps):
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    probe = held.sum()  # not through a view: views coming and going would change its pre-copy stamp
    print(f"step {step} loss {loss.item():.8f} held {probe.item():.4f}", flush=True)
    time.sleep(0.02)
while args.hold and not os.path.exists(args.hold):
    time.sleep(0.05)
print(f"held sum {held.double().sum().item():.10f}", flush=True)
