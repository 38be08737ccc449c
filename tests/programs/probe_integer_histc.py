"""`histc` of integers, which CUDA counts (transformers' mixtures of experts count the tokens per
expert so on any device but the CPU) and the host's kernel refuses: a direct run counts floats
and converts, as such code does on the CPU; both must print the same counts and dtypes."""

import sys

import torch

device = sys.argv[1]
expert_ids = torch.tensor([0, 1, 1, 3, 2, 1, 7, -2, 5, 3], device=device)
for dtype in (torch.int32, torch.int64, torch.int16, torch.uint8):
    values = expert_ids.clamp(min=0).to(dtype)
    for bins, low, high in ((4, 0, 3), (3, 0, 0), (5, 1, 6)):
        counted = values.float() if device == "cpu" else values
        counts = torch.histc(counted, bins=bins, min=low, max=high).to(dtype)
        print(dtype, bins, low, high, counts.dtype, counts.tolist())
