"""A host tensor given with device tensors to one call: refused as CUDA refuses it (modules and
losses included, whose calls torch's own code makes), or taken where CUDA takes it."""

import torch
import torch.nn.functional as F

x = torch.randn(3, 4)
calls = {
    "linear": lambda: torch.nn.Linear(4, 2).cuda()(x),
    "conv": lambda: torch.nn.Conv2d(1, 1, 3).cuda()(torch.randn(1, 1, 5, 5)),
    "embedding": lambda: torch.nn.Embedding(10, 3).cuda()(torch.tensor([1, 2])),
    "layer_norm": lambda: torch.nn.LayerNorm(4).cuda()(x),
    "batch_norm": lambda: torch.nn.BatchNorm1d(4).cuda()(x),
    "cross_entropy": lambda: F.cross_entropy(torch.randn(2, 3, device="cuda"), torch.tensor([0, 1])),
    "mse_loss": lambda: F.mse_loss(torch.randn(3, device="cuda"), torch.randn(3)),
    "cat": lambda: torch.cat([torch.randn(3, device="cuda"), torch.randn(3)]),
    "stack": lambda: torch.stack([torch.randn(3, device="cuda"), torch.randn(3)]),
    "index with host indices": lambda: torch.randn(5, device="cuda")[torch.tensor([1, 2])],
    "0-dim host scalar": lambda: torch.randn(3, device="cuda") * torch.tensor(2.0),
    "copy_ from the host": lambda: torch.zeros(3, device="cuda").copy_(torch.ones(3)),
    "module on its device": lambda: torch.nn.Linear(4, 2).cuda()(x.cuda()),
}
for name, call in calls.items():
    try:
        call()
        print(name, "taken")
    except RuntimeError:
        print(name, "refused")
