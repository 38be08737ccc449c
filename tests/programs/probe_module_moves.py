"""Moving modules and loading weights as on a GPU: `Module.to` keeps each Parameter (an optimizer
made before the move still steps the model; tied weights stay tied), `load_state_dict` copies in
place (also while a graph or a view holds a parameter; `assign=True` gives new Parameters),
`p.data = p.data.to(device)` moves a parameter, the old `weight_norm` moves with its module, and a
lazy module moved before its first forward makes its parameters on the device."""

import sys

import torch
from torch import nn

device = sys.argv[1]


def attempt(name, work):
    try:
        print(name, work())
    except Exception as error:  # printed, so that a failure shows as a difference
        print(name, "failed:", type(error).__name__, str(error).splitlines()[0][:120])


torch.manual_seed(0)
model = nn.Linear(3, 2)
before = model.weight
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # made before the move, as some programs do
model.to(device)
model(torch.ones(1, 3, device=device)).sum().backward()
optimizer.step()
print("optimizer made before the move", model.weight is before, model.weight.tolist())

tied = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
tied[1].weight = tied[0].weight
tied.to(device).double()
print("tied", tied[1].weight is tied[0].weight, tied[0].weight.dtype, round(tied[0].weight.sum().item(), 6))

saved = {name: value.clone() for name, value in model.state_dict().items()}
out = model(torch.ones(2, 3, device=device))  # a live graph holds the parameters
view = model.weight[0]  # and a view
model.load_state_dict(saved)
print("load while held", model.weight is before, model.weight.tolist(), view.tolist())
out.sum().backward()
fresh = {name: torch.zeros_like(value) for name, value in saved.items()}
model.load_state_dict(fresh, assign=True)
optimizer.step()  # steps the old Parameters: the model keeps the zeros
print("assign", model.weight is before, model.weight.tolist())

plain = nn.Linear(2, 2)
plain.weight.data = plain.weight.data.to(device)
plain.bias.data = plain.bias.data.to(device)
print("data moved", plain.weight.device.type == device, plain(torch.ones(1, 2, device=device)).tolist())
plain.weight.data = plain.weight.data.to("cpu")
print("data back", plain.weight.device.type, plain.weight.tolist())

conv = nn.utils.weight_norm(nn.Conv1d(2, 2, 3))
attempt("old weight_norm to", lambda: conv.to(device).weight_v.device.type == device)
attempt("old weight_norm forward", lambda: conv(torch.ones(1, 2, 5, device=device)).tolist())
attempt("old weight_norm load", lambda: conv.load_state_dict(conv.state_dict()) is not None)
lazy = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(2)).to(device)
lazy_out = lazy(torch.ones(3, 5, device=device))  # kept: its graph holds the parameters
weight = lazy[0].weight
print("lazy", lazy_out.tolist(), weight.device.type == device, isinstance(weight, nn.Parameter))
lazy.double()
print("lazy moved after a forward", lazy[0].weight.dtype, lazy[0].weight.device.type == device)
back = model.cpu()
print("back", back.weight is before, back.weight.device.type, back.weight.tolist())

tagged = nn.Linear(3, 1, bias=False)
with torch.no_grad():
    tagged.weight.fill_(1.0)
tagged.weight._no_weight_decay = True  # attributes and hooks the program gave a parameter
tagged.weight.register_hook(lambda grad: grad * 100)
accumulated = []
tagged.weight.register_post_accumulate_grad_hook(lambda p: accumulated.append(p.grad.sum().item()))
tagged.to(device)
tagged(torch.ones(2, 3, device=device)).sum().backward()
print("tagged", getattr(tagged.weight, "_no_weight_decay", None), tagged.weight.grad.tolist(), accumulated)
tagged.cpu()
tagged.weight.grad = None
tagged(torch.ones(1, 3)).sum().backward()
print("tagged back", tagged.weight._no_weight_decay, tagged.weight.grad.tolist(), accumulated)
