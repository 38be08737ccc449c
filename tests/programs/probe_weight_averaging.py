"""Stochastic weight averaging and EMA (`torch.optim.swa_utils`): the averaged weights and buffers
of a small model with BatchNorm, printed as digests of their bytes so one differing bit shows."""

import hashlib
import sys

import torch
from torch import nn
from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn, update_bn

device = sys.argv[1]


def digest(module: nn.Module) -> str:
    state = [value.detach().cpu().contiguous() for value in module.state_dict().values()]
    return hashlib.sha256(b"".join(value.numpy().tobytes() for value in state)).hexdigest()[:16]


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)).to(device)
averages = {
    "swa": AveragedModel(model),
    "swa buffers": AveragedModel(model, use_buffers=True),
    "ema": AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9)),
}
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = SWALR(optimizer, swa_lr=0.05, anneal_epochs=2)
batches = [torch.randn(8, 16, device=device) for _ in range(4)]
for step, batch in enumerate(batches):
    optimizer.zero_grad()
    model(batch).square().mean().backward()
    optimizer.step()
    scheduler.step()
    for average in averages.values():
        average.update_parameters(model)
    print("step", step, *(f"{name} {digest(average)}" for name, average in averages.items()))
update_bn(batches, averages["swa"], device=torch.device(device))
print("update_bn", digest(averages["swa"]))
