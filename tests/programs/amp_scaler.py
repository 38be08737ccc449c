"""Mixed precision with autocast and GradScaler on whatever device is there."""

import torch
from _common import checksum
from torch import nn

device_type = "cuda" if torch.cuda.is_available() else "cpu"
device = torch.device(device_type)
torch.manual_seed(5)
model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 10)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler(device_type, init_scale=2.0**10)
x = torch.randn(64, 64).to(device)
y = torch.randint(0, 10, (64,)).to(device)
for step in range(15):
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
        out = model(x)
        loss = nn.functional.cross_entropy(out, y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    print(f"step {step} loss {loss.item():.8f} dtype {out.dtype} scale {scaler.get_scale():.1f}")
print("final", checksum(model))
