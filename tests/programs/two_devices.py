"""Each rank trains a model split over two devices: the first half on cuda:0, the second on
cuda:1, activations and gradients crossing between them (pipeline-style model parallelism).

Launched torchrun-style (RANK), every rank uses both cuda:0 and cuda:1, with data of its own and
no collectives. It prints how many devices it sees, its loss at each step and, at the end, a
checksum of each half. With --hold FILE it waits, after the last step, until FILE exists (a
test's signal to end).
"""

import argparse
import os
import time

import torch
from _common import checksum
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--width", type=int, default=64)
parser.add_argument("--hold", help="after the last step, wait until this file exists")
parser.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after each step")
args = parser.parse_args()

first_device, second_device = torch.device("cuda", 0), torch.device("cuda", 1)
torch.manual_seed(4321)
first = nn.Sequential(nn.Linear(args.width, args.width), nn.Tanh()).to(first_device)
second = nn.Sequential(nn.Linear(args.width, args.width), nn.Tanh(), nn.Linear(args.width, 4)).to(
    second_device
)
optimizer = torch.optim.Adam([*first.parameters(), *second.parameters()], lr=1e-3)
rank = int(os.environ.get("RANK", "0"))
generator = torch.Generator().manual_seed(99 + rank)
print(f"rank {rank} sees {torch.cuda.device_count()} devices", flush=True)

for step in range(args.steps):
    optimizer.zero_grad()
    x = torch.randn(8, args.width, generator=generator).to(first_device)
    y = torch.randint(0, 4, (8,), generator=generator).to(second_device)
    hidden = first(x).to(second_device)
    loss = nn.functional.cross_entropy(second(hidden), y)
    loss.backward()
    optimizer.step()
    print(f"rank {rank} step {step} loss {loss.item():.10f} on {hidden.device}", flush=True)
    if args.sleep:
        time.sleep(args.sleep)

while args.hold and not os.path.exists(args.hold):
    time.sleep(0.05)
print(f"rank {rank} final {checksum(first)} {checksum(second)}", flush=True)
