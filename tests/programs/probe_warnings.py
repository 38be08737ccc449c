"""Warnings torch raises inside operations (C++ warnings and torch's own Python ones), shown on
stderr and recorded with the file and line they are attributed to: a proxied run gives the lines
a direct run gives."""

import os
import sys
import warnings

import torch
import torch.nn.functional as F

warnings.simplefilter("always")
device = sys.argv[1]
x = torch.ones(3, 3, device=device, requires_grad=True)
y = x.sum()
y.grad  # noqa: B018 (the .grad of a tensor that is not a leaf)
torch.tensor(x)
F.softmax(torch.ones(2, 2, device=device))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    y.grad  # noqa: B018
    F.softmax(torch.ones(2, 2, device=device))
print("recorded", [f"{os.path.basename(w.filename)}:{w.lineno} {w.category.__name__}" for w in caught])
