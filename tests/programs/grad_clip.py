"""GRU classifier with clip_grad_norm_ and clip_grad_value_, RMSprop."""

import torch
from _common import checksum
from torch import nn

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(6)


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(8, 24, batch_first=True)
        self.out = nn.Linear(24, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, h = self.gru(x)
        return self.out(h[-1])


model = Classifier().to(device)
opt = torch.optim.RMSprop(model.parameters(), lr=1e-2)
for step in range(15):
    x = torch.randn(16, 10, 8).to(device)
    y = (x.sum(dim=(1, 2)) > 0).long() + (x[:, 0, 0] > 1).long()
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.05)
    opt.step()
    print(f"step {step} loss {loss.item():.8f} norm {norm.item():.6f}")
print("final", checksum(model))
