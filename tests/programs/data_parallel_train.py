"""`nn.DataParallel` over every visible device, as older training scripts use it: one process
scatters each batch across the devices, replicates the model (its BatchNorm buffers too), runs
the replicas in threads and sums the gradients on the first device.

Prints each step's loss and the weights' checksum; with CORPUS_HOLD it waits before the checksum.
"""

import argparse

import torch
from _common import checksum
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=40)
args = ap.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
devices = torch.cuda.device_count() if device == "cuda" else 0
print("devices", devices, flush=True)
torch.manual_seed(3)
net = nn.Sequential(nn.Linear(24, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 5)).to(device)
model = nn.DataParallel(net) if devices > 1 else net
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
data = torch.randn(96, 24)
labels = torch.randint(0, 5, (96,))
for step in range(args.steps):
    batch = slice(32 * (step % 3), 32 * (step % 3 + 1))
    out = model(data[batch] if devices > 1 else data[batch].to(device))  # DataParallel scatters a host batch
    loss = nn.functional.cross_entropy(out, labels[batch].to(device))
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r} on {out.device}", flush=True)
print("final", checksum(net), flush=True)
