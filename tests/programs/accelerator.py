"""Device selection the way today's pytorch/examples do it, with torch.accelerator."""

import torch
import torch.nn.functional as F
from _common import checksum
from torch import nn

if torch.accelerator.is_available():  # noqa: SIM108 (as pytorch/examples write it)
    device = torch.accelerator.current_accelerator()
else:
    device = torch.device("cpu")
torch.manual_seed(9)
model = nn.Sequential(
    nn.Conv1d(4, 8, 5), nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(8, 2)
).to(device)
opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
for step in range(15):
    x = torch.randn(32, 4, 20)
    target = (x.mean(dim=(1, 2)) > 0).long()
    x, target = x.to(device), target.to(device)
    out = model(x)
    loss = F.nll_loss(F.log_softmax(out, dim=1), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if device.type != "cpu":
        torch.accelerator.synchronize()
    print(f"step {step} loss {loss.item():.8f}")
print("final", checksum(model))
