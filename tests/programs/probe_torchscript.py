"""TorchScript with a module on a proxied device: scripted and traced modules run and move, a
saved host module loads onto the device with map_location, and saving a module that holds device
tensors is refused (TorchScript's serializer reads tensor memory itself: it wrote zeros)."""

import io

import torch
from torch import nn

model = nn.Linear(3, 1)
with torch.no_grad():
    model.weight.copy_(torch.tensor([[1.0, 2.0, 3.0]]))
    model.bias.fill_(0.5)
scripted = torch.jit.script(model).to("cuda")
print("scripted", scripted.weight.device, scripted(torch.ones(2, 3, device="cuda")).tolist())
traced = torch.jit.trace(nn.Linear(3, 1), torch.ones(1, 3)).cuda()
print("traced", traced.weight.device, traced(torch.ones(1, 3, device="cuda")).shape)
saved = io.BytesIO()
torch.jit.save(torch.jit.script(nn.Linear(3, 1).requires_grad_(False).cpu()), saved)
saved.seek(0)
loaded = torch.jit.load(saved, map_location="cuda")
print("loaded", loaded.weight.device, loaded(torch.ones(1, 3, device="cuda")).device)
for name, attempt in {
    "jit.save": lambda: torch.jit.save(scripted, io.BytesIO()),
    "save": lambda: scripted.save(io.BytesIO()),
}.items():
    try:
        attempt()
        print(name, "wrote")
    except RuntimeError as error:
        print(name, error)
