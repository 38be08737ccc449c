"""An MLP trained from a DataLoader with worker processes and a pin-memory thread, as most
training scripts feed a GPU; a loss printed every step. The workers hand batches over in shared
memory files that are deleted while open (torch's file_descriptor sharing).

With --hold FILE it waits, before its final line, until FILE exists (a test's signal to end).
"""

import argparse
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=60)
ap.add_argument("--workers", type=int, default=2)
ap.add_argument("--width", type=int, default=32, help="input features (32 x 4 x width bytes a batch)")
ap.add_argument("--hold", help="before the final line, wait until this file exists")
args = ap.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(3)
inputs = torch.randn(256, args.width)
data = TensorDataset(inputs, inputs[:, :4].sum(dim=1, keepdim=True))
loader = DataLoader(
    data, batch_size=32, shuffle=True, num_workers=args.workers, pin_memory=True, persistent_workers=True,
    generator=torch.Generator().manual_seed(5),
)  # fmt: skip
model = nn.Sequential(nn.Linear(args.width, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
step = 0
while step < args.steps:
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.8f}", flush=True)
        step += 1
        if step == args.steps:
            break
while args.hold and not os.path.exists(args.hold):
    time.sleep(0.05)
print("weights", f"{sum(float(p.detach().double().sum()) for p in model.parameters()):.10f}", flush=True)
