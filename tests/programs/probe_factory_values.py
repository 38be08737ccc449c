"""Factories given a device scalar as a value (`torch.full(..., fill_value=eos)`, as beam search
does; `torch.arange(end=n)`), by keyword and by position: made on the device with its value."""

import sys

import torch

device = sys.argv[1]
eos = torch.tensor(7, device=device)
scale = torch.tensor(2.5, device=device)
for name, made in [
    ("full keyword", lambda: torch.full((2, 3), fill_value=eos, dtype=torch.int64, device=device)),
    ("full position", lambda: torch.full((2,), scale, device=device)),
    ("full float keyword", lambda: torch.full((3,), fill_value=scale, device=device)),
    ("arange end", lambda: torch.arange(end=eos, device=device)),
    ("arange position", lambda: torch.arange(0, eos, 2, device=device)),
    ("linspace", lambda: torch.linspace(0, scale, 3, device=device)),
]:
    tensor = made()
    print(name, tensor.device == eos.device, tensor.dtype, tensor.tolist())
