"""Holds SIZE MiB of tensors on its cuda device and times its own steps until a file appears.

How a checkpoint feels from inside a job: each step trains a small model a little and reads one
value back, so it waits for the device. It says "ready" once its steps are short (the first ones
set up kernels and the proxy's operation plans, which takes a while). Every later step longer
than 20 ms is printed as
"stall END SECONDS", by the wall clock: CRIU restores a process in a time namespace that hides
the time it was stopped from CLOCK_MONOTONIC, so only the wall clock shows a preemption whole.
Usage: stall_probe.py HOLD_FILE SIZE_MIB
"""

from __future__ import annotations

import os
import sys
import time

import torch

STALL_S = 0.02
"""A step longer than this is a stall."""
WARM_STEPS = 3
"""Steps in a row shorter than STALL_S before the probe says it is ready."""

hold, size_mib = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
chunk = 64 << 20
size = size_mib << 20
state = [torch.ones(min(chunk, size - i) // 4, device="cuda") for i in range(0, size, chunk)]
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
data = torch.randn(32, 64, device="cuda")


def step() -> None:
    """Train the model a little and wait for the device."""
    loss = model(data).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    loss.item()


short = 0
while short < WARM_STEPS:
    began = time.time()
    step()
    short = short + 1 if time.time() - began < STALL_S else 0
steps = 0
last = time.time()
print("ready", flush=True)
while not os.path.exists(hold):
    step()
    steps += 1
    now = time.time()
    if now - last > STALL_S:
        print(f"stall {now:.6f} {now - last:.6f}", flush=True)
    last = now
held = sum(t.numel() * t.element_size() for t in state) >> 20
checksum = sum(float(t.sum().item()) for t in state)
print(f"done: {held} MiB held, {steps > 0}, checksum {checksum:.0f}", flush=True)
