"""Trains on cuda:0 and first touches cuda:1 only once a file exists (a test's signal).

A process's first use of a device opens its connection to that device's proxy, so a test can make
that happen at an exact moment of a checkpoint. It prints its loss at each step, the sum of what it
made on cuda:1 once it did, and at the end a checksum of the model: all independent of when the
file appeared. With --hold FILE it waits, after the last step, until FILE exists.
"""

import argparse
import os
import time

import torch
from _common import checksum
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--join", required=True, help="touch cuda:1 once this file exists")
parser.add_argument("--hold", help="after the last step, wait until this file exists")
parser.add_argument("--sleep", type=float, default=0.05, help="seconds to sleep after each step")
args = parser.parse_args()

torch.manual_seed(1234)
model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).to("cuda:0")
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
generator = torch.Generator().manual_seed(7)
joined: torch.Tensor | None = None


def join_if_asked() -> None:
    """Make a tensor on cuda:1 the first time the join file exists."""
    global joined
    if joined is None and os.path.exists(args.join):
        joined = torch.arange(16, dtype=torch.float32, device="cuda:1") * 2
        print(f"joined cuda:1 sum {joined.sum().item():.1f}", flush=True)


for step in range(args.steps):
    join_if_asked()
    x = torch.randn(64, 32, generator=generator).to("cuda:0")
    loss = nn.functional.mse_loss(model(x), x[:, :1] * 0.5)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.10f}", flush=True)
    time.sleep(args.sleep)
while args.hold and not os.path.exists(args.hold):
    join_if_asked()
    time.sleep(0.05)
join_if_asked()
print(f"final {checksum(model)}", flush=True)
