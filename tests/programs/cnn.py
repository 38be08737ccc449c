"""Small CNN on random images with BatchNorm, Dropout and SGD momentum; --device flag."""

import argparse

import torch
import torch.nn.functional as F
from _common import checksum
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
ap.add_argument("--steps", type=int, default=12)
args = ap.parse_args()
device = torch.device(args.device)
torch.manual_seed(1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.drop(torch.flatten(x, 1))
        return self.fc(x)


model = Net().to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
for step in range(args.steps):
    images = torch.randn(16, 3, 16, 16, device=device)
    labels = torch.randint(0, 10, (16,), device=device)
    model.train()
    out = model(images)
    loss = F.cross_entropy(out, labels)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    acc = (out.argmax(dim=1) == labels).float().mean()
    print(f"step {step} loss {loss.item():.8f} acc {acc.item():.4f}")
model.eval()
with torch.no_grad():
    test = model(torch.ones(2, 3, 16, 16, device=device))
print("eval", [f"{v:.6f}" for v in test[0, :3].tolist()])
print("final", checksum(model))
