"""An ordinary PyTorch training script (CPU): fixed seed, prints the loss every step and a checksum
of the final weights. Tests run it unmodified, directly and under singularityd.

With --bf16 its matrix products run in bfloat16, which torch's oneDNN computes with AMX where the
CPU has it. With --hold FILE it waits, before the checksum, until FILE exists: a test that must find the job
still running when it preempts or checkpoints it creates FILE only once it is done with it.
"""

import argparse
import hashlib
import os
import time

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--sleep", type=float, default=0.0, help="seconds to idle after each step")
parser.add_argument("--hold", help="before the checksum, wait until this file exists")
parser.add_argument("--bf16", action="store_true", help="compute in bfloat16 (torch.autocast on the CPU)")
args = parser.parse_args()

torch.manual_seed(1234)
model = nn.Sequential(
    nn.Linear(64, args.hidden),
    nn.ReLU(),
    nn.Linear(args.hidden, args.hidden),
    nn.ReLU(),
    nn.Linear(args.hidden, 10),
)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loss_fn = nn.CrossEntropyLoss()
inputs = torch.randn(512, 64)
targets = torch.randint(0, 10, (512,))

for step in range(args.steps):
    batch = torch.randint(0, 512, (64,))
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
        loss = loss_fn(model(inputs[batch]), targets[batch])
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.10f}", flush=True)
    if args.sleep:
        time.sleep(args.sleep)

while args.hold and not os.path.exists(args.hold):
    time.sleep(0.05)

digest = hashlib.sha256()
for tensor in model.state_dict().values():
    digest.update(tensor.numpy().tobytes())
print(f"final weights sha256 {digest.hexdigest()}", flush=True)
