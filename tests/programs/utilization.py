"""torch.cuda.utilization while the device works and once it has been idle for over a second.

With `--forever` it keeps the device busy until it is stopped (for `sing devices`)."""

import sys
import time

import torch

x = torch.randn(1024, 1024, device="cuda")
x = torch.tanh(x @ x)  # the first operations set up the client: on a loaded machine, seconds of it
torch.cuda.synchronize()
deadline = time.monotonic() + (1e9 if "--forever" in sys.argv else 1.5)
while time.monotonic() < deadline:
    for _ in range(8):
        x = torch.tanh(x @ x)
    torch.cuda.synchronize()
busy = torch.cuda.utilization()
print("busy", 30 <= busy <= 100, type(busy).__name__, flush=True)
time.sleep(1.5)
print("idle", torch.cuda.utilization(0))
