"""`torch.set_default_dtype(torch.float64)`: the dtype and values of what integer operands promote
to, of factories and of layers made on the device, switched back and forth (each operation runs
under both defaults, so a result kept from the other default shows)."""

import sys

import torch

device = sys.argv[1]
integers = torch.tensor([1, 2, 3], device=device)
floats = torch.zeros(2, device=device, dtype=torch.float32)


def show(name: str, value: torch.Tensor) -> None:
    print(name, value.dtype, [repr(x) for x in value.detach().cpu().flatten().tolist()])


def promoted_and_made() -> None:
    show("int / 3", integers / 3)
    show("int * 0.1", integers * 0.1)
    show("sqrt(int)", torch.sqrt(integers))
    show("sigmoid(int)", torch.sigmoid(integers))
    show("bool * 1.5", (integers > 1) * 1.5)
    show("float32 + 0.1", floats + 0.1)
    show("zeros + 0.1", torch.zeros(2, device=device) + 0.1)
    show("full", torch.full((2,), 0.1, device=device))
    show("arange", torch.arange(0, 0.3, 0.1, device=device))
    show("linspace", torch.linspace(0, 1, 3, device=device))
    show("tensor", torch.tensor([0.1], device=device))
    show("new_full", floats.new_full((2,), 0.1))
    show("empty.fill_", torch.empty(2, device=device).fill_(0.1))
    torch.manual_seed(0)
    show("randn", torch.randn(2, device=device))
    layer = torch.nn.Linear(3, 2, device=device)
    show("Linear", layer(integers.to(torch.get_default_dtype())))


for default in (torch.float64, torch.float32, torch.float64):
    torch.set_default_dtype(default)
    print("default", default)
    promoted_and_made()
