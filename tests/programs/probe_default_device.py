"""The default device set to a cuda one (`torch.set_default_device`, `with torch.device(...)`), as
recent training and inference code does to build models and tensors straight on the GPU: its
factories, modules and `torch.get_default_device()` place tensors there; explicit devices win."""

import sys

import torch

device = sys.argv[1]


def where(tensor: torch.Tensor) -> str:
    return "device" if tensor.device.type == device else tensor.device.type


torch.manual_seed(0)
with torch.device(device):
    layer = torch.nn.Linear(3, 2)
    print("context", where(layer.weight), where(torch.randn(2)), where(torch.tensor([1.0, 2.0])))
    print("explicit cpu inside", torch.zeros(2, device="cpu").device.type)
print("after context", torch.zeros(1).device.type)
torch.set_default_device(device)
print("default", torch.get_default_device().type == device, where(torch.arange(3)), where(torch.empty(2, 2)))
made = [torch.randn(2, 3), torch.full((2,), 3.0), torch.linspace(0, 1, 4), torch.eye(2), torch.randperm(5)]
print("values", [tensor.tolist() for tensor in made], {where(tensor) for tensor in made})
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.randn(16, 4)
for step in range(3):
    loss = model(data).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print("step", step, where(loss), repr(loss.item()))
print(
    "host tensors", torch.zeros(2, device="cpu").device.type, torch.from_numpy(data.cpu().numpy()).device.type
)
torch.set_default_device(None)
print("reset", torch.zeros(1).device.type)
