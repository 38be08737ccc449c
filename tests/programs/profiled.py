"""torch.profiler asked for CPU and CUDA activity around a few operations on the accelerator, as a
performance tutorial does; prints the operators it recorded."""

import torch
from torch.profiler import ProfilerActivity, profile

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
    x = torch.ones(32, 32, device="cuda")
    total = (x @ x).sum().item()
names = sorted({event.key for event in prof.key_averages()})
print("recorded", "aten::mm" in names, "aten::sum" in names, total)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=3).count("aten::") > 0)
