"""Transfers larger than one frame: uploads, random fills, host index tensors and downloads."""

import sys

import torch

device = sys.argv[1]
torch.manual_seed(0)
host = torch.arange(20 << 20, dtype=torch.float32)  # 80 MiB: sent in chunks
x = host.to(device)
print("upload", x.sum().item(), x[-1].item())
w = torch.empty(12 << 20, device=device).normal_()  # 48 MiB of random numbers filled from the host
print("fill", w.sum().item())
index = torch.randint(0, 20 << 20, (3 << 20,))  # 24 MiB host index: uploaded before the operation
print("index", x[index].sum().item(), x[index.to(device)].sum().item())
back = (x * 2).cpu()
print("download", back.sum().item(), bool(torch.equal(back, host * 2)))
