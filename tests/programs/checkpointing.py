"""Trains, saves model and optimizer with torch.save, reloads into a fresh model, goes on."""

import os
import sys
import tempfile

import torch
from _common import checksum
from torch import nn

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(8)
x = torch.randn(64, 10)
y = (x[:, 0] > 0).long()
x, y = x.to(device), y.to(device)


def make():
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2)).to(device)


def train(model, opt, steps, start):
    for step in range(start, start + steps):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.8f}")


model = make()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
train(model, opt, 6, 0)
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "ckpt.pt")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": 6}, path)
    print("saved", os.environ.get("CKPT_COPY", "") != "", file=sys.stderr)
    if os.environ.get("CKPT_COPY"):
        import shutil

        shutil.copy(path, os.environ["CKPT_COPY"])
    ckpt = torch.load(path, map_location=device)
    on_cpu = torch.load(path, map_location="cpu")
    print("cpu copy", on_cpu["model"]["0.weight"].device, f"{on_cpu['model']['0.weight'].sum().item():.6f}")
model2 = make()
opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
model2.load_state_dict(ckpt["model"])
opt2.load_state_dict(ckpt["opt"])
print("loaded step", ckpt["step"], "same", checksum(model2) == checksum(model))
train(model2, opt2, 6, 6)
print("final", checksum(model2))
