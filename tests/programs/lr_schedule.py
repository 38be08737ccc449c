"""Linear model with OneCycleLR, then StepLR after a switch; prints learning rates."""

import torch
from _common import checksum
from torch import nn

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(7)
model = nn.Sequential(nn.Linear(20, 40), nn.SiLU(), nn.Linear(40, 1)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=10)
x = torch.randn(128, 20, device=device)
y = x[:, :5].sum(dim=1, keepdim=True) ** 2
for step in range(20):
    if step == 10:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    loss = nn.functional.smooth_l1_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    print(f"step {step} loss {loss.item():.8f} lr {opt.param_groups[0]['lr']:.6f}")
print("final", checksum(model))
