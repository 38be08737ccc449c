"""Uses torch.cuda heavily, then reports whether this process holds any CUDA state."""

import contextlib
import os

import torch

torch.cuda.init()
print("available", torch.cuda.is_available(), "count", torch.cuda.device_count())
x = torch.randn(8, 8, device="cuda")
y = (x @ x).relu().sum()
torch.cuda.synchronize()
print("value", f"{y.item():.4f}" != "")
print("is_initialized", torch.cuda.is_initialized())
fds = []
for fd in os.listdir("/proc/self/fd"):
    with contextlib.suppress(OSError):
        fds.append(os.readlink(f"/proc/self/fd/{fd}"))
print("nvidia fds", [f for f in fds if "nvidia" in f])
with open("/proc/self/maps") as f:
    maps = f.read()
print(
    "cuda libraries", sorted({w for w in ("libcuda.so", "libcudart", "libnvidia", "libcublas") if w in maps})
)
print("real lazy init ran", bool(getattr(torch.cuda, "_initialized", False)))
print("torch has cuda build", torch.backends.cuda.is_built())
