"""The threads a program sees: its own only (a GPU's driver threads are not Python threads), with
a thread of its own started and joined. Run with `cpu` or `cuda`: both must print the same."""

import sys
import threading

import torch

device = sys.argv[1]
total = torch.ones(3, device=device).sum()
print("before", threading.active_count(), [(t.name, t.daemon) for t in threading.enumerate()])
worker = threading.Thread(target=lambda: print("worker sum", torch.ones(2, device=device).sum().item()))
worker.start()
worker.join()
print("after", threading.active_count(), [(t.name, t.daemon) for t in threading.enumerate()], total.item())
