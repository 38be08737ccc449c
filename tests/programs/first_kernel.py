"""Makes two operands on the device (and runs a kernel over many elements), waits with nothing
queued (`--hold FILE`: until FILE exists), then runs a matrix product of a transposed operand as
its first operation after the wait and prints a hash of its bytes. A checkpoint taken during the
wait makes that product the first kernel its restored proxy server runs for the process."""

import argparse
import hashlib
import os
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--hold", help="wait for this file before the product")
args = parser.parse_args()

generator = torch.Generator().manual_seed(5)
grads = torch.randn(16, 5, generator=generator).cuda() * 0.01
activations = torch.relu(torch.randn(16, 64, generator=generator)).cuda()
total = torch.ones(1 << 16, device="cuda").sum()  # a kernel over many elements, as training runs
torch.cuda.synchronize()
print("ready", flush=True)
while args.hold and not os.path.exists(args.hold):
    time.sleep(0.05)
product = torch.mm(grads.t(), activations)
print("product", hashlib.sha256(product.cpu().numpy().tobytes()).hexdigest(), flush=True)
