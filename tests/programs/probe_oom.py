"""Runs out of memory on a small device, recovers and goes on."""

import torch

assert torch.cuda.is_available()
total = torch.cuda.get_device_properties(0).total_memory
print("total", total)
try:
    big = torch.empty(total // 2, dtype=torch.float32, device="cuda")
    print("big allocated")
except torch.cuda.OutOfMemoryError as e:
    print("big OutOfMemoryError", str(e).startswith("CUDA out of memory."))
keep = []
try:
    for _ in range(1000):
        keep.append(torch.ones(64, 1024, device="cuda") * 2)  # 256 KiB each, asynchronously
    torch.cuda.synchronize()
    print("small no error")
except torch.OutOfMemoryError as e:
    print("small OutOfMemoryError", "CUDA out of memory" in str(e))
print("allocated before free", torch.cuda.memory_allocated() > total // 2)
keep.clear()
x = torch.ones(10, device="cuda")
print("allocated after free", torch.cuda.memory_allocated())
print("sum", x.sum().item())
