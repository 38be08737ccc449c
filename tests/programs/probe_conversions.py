"""Where conversions put tensors and what shapes they report: `Module.to("cpu")`, `x.to(other)`,
`Module.to(tensor)`, `type_as` and the `*_as` methods given a host template, shallow copies, and
sparse tensors of the same shape but different numbers of elements, printed the same on the CPU
and on a device."""

import copy
import sys

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

device = sys.argv[1]
torch.manual_seed(0)


def show(name, call):
    try:
        print(name, call())
    except Exception as e:
        print(name, "ERR", type(e).__name__, str(e)[:100])


model = nn.Linear(2, 2).to(device)
model.to("cpu")
show(
    "module to cpu",
    lambda: (model.weight.device.type, model(torch.ones(1, 2)).detach().numpy().round(4).tolist()),
)
model.to(device).to(torch.device("cpu"))
show("module to cpu device", lambda: model.bias.device.type)
show(
    "averaged on cpu",
    lambda: next(AveragedModel(nn.Linear(2, 2).to(device), device="cpu").parameters()).device.type,
)
ref = torch.ones(2, device=device)
show(
    "host to other",
    lambda: (torch.tensor([1, 2]).to(ref).dtype, torch.tensor([1, 2]).to(ref).device == ref.device),
)
show("device to other", lambda: (torch.tensor([1, 2], device=device).to(ref) + ref).tolist())
show("module to tensor", lambda: nn.Linear(1, 1).to(ref).weight.device == ref.device)
show(
    "type_as device",
    lambda: (torch.tensor([1, 2]).type_as(ref).device == ref.device, torch.tensor([1]).type_as(ref).dtype),
)
x = torch.arange(4.0, device=device)
template = torch.empty(2, 2)
show("type_as host", lambda: (x.type_as(template).device.type, x.type_as(template.double()).dtype))
show(
    "view_as",
    lambda: (
        x.view_as(template).shape,
        x.reshape_as(template).shape,
        x[:2].view(1, 2).expand_as(template).shape,
    ),
)
show("resize_as_", lambda: x.clone().resize_as_(template).shape)
show("tensor_split", lambda: [t.tolist() for t in torch.tensor_split(x, torch.tensor([1, 3]))])

shallow = copy.copy(x)
shallow[0] = 9.0
show("copy shares storage", lambda: x[0].item())
show(
    "copy of parameter",
    lambda: (lambda p: (isinstance(p, nn.Parameter), p.requires_grad, p.tolist()))(
        copy.copy(nn.Parameter(x))
    ),
)


def sparse(tag, s):
    values = s.values()
    print(
        tag,
        s._nnz(),
        tuple(s.indices().shape),
        tuple(values.shape),
        values.tolist(),
        (values * 2).sum().item(),
    )


sparse("a", torch.tensor([[1.0, 2.0], [3.0, 0.0]], device=device).to_sparse())
sparse("b", torch.tensor([[1.0, 0.0], [0.0, 0.0]], device=device).to_sparse())
sparse(
    "s1",
    torch.sparse_coo_tensor(torch.tensor([[0, 1, 2]]), torch.tensor([1.0, 2.0, 3.0]), (4,))
    .to(device)
    .coalesce(),
)
sparse("s2", torch.sparse_coo_tensor(torch.tensor([[1, 1, 1]]), torch.ones(3), (4,)).to(device).coalesce())
dense_rows = torch.eye(2, device=device).to_sparse(1)
print("sparse rows", tuple(dense_rows.indices().shape), tuple(dense_rows.values().shape))
