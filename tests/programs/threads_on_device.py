"""Device work from threads the program starts: a DataLoader's pin-memory thread, a plain thread,
a thread pool. Values printed must match a direct CPU run; the devices must be the one asked for."""

import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.utils.data import DataLoader, TensorDataset

device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
weights = torch.randn(8, 1).to(device)


def report(name: str, tensor: torch.Tensor) -> None:
    """Print a result's values, and whether it is on the asked device."""
    print(name, tensor.device.type == torch.device(device).type, f"{tensor.sum().item():.6f}", flush=True)


loader = DataLoader(data, batch_size=16, num_workers=2, pin_memory=True)
for step, (inputs, targets) in enumerate(loader):
    inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
    report(f"loader step {step}", (inputs @ weights - targets) ** 2)

made: list[torch.Tensor] = []


def in_a_thread() -> None:
    """Make a tensor on the device and compute with one the main thread made."""
    made.append(torch.ones(8, 1, device=device) + weights)


worker = threading.Thread(target=in_a_thread)
worker.start()
worker.join()
report("thread", made[0])

with ThreadPoolExecutor(max_workers=2) as pool:
    moved = list(pool.map(lambda t: t.to(device) * 2, [torch.full((3,), float(i)) for i in range(4)]))
for i, tensor in enumerate(moved):
    report(f"pool {i}", tensor)
