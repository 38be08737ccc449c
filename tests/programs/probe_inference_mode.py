"""Evaluation under `torch.inference_mode()` (evaluation loops, generation): views of normal tensors
made there are normal tensors, other results are inference tensors, and the rules for updating
either in place afterwards are torch's."""

import sys

import torch

device = sys.argv[1]
torch.manual_seed(0)
x = torch.arange(6.0, device=device).reshape(2, 3)
layer = torch.nn.Linear(3, 2).to(device)


def show(name: str, tensor: torch.Tensor) -> None:
    print(name, tensor.tolist(), tensor.is_inference())


with torch.inference_mode():
    show("t", x.t())
    show("view", x.view(3, 2))
    show("slice", x[:, 1])
    show("unsqueeze", x.unsqueeze(0))
    show("detach", x.detach())
    show("view of a view", x[0].unsqueeze(0))
    print("split", [part.is_inference() for part in x.split(1)], [part.tolist() for part in x.unbind(0)])
    show("linear", layer(x))
    show("linear of a view", layer(x.t().t()))
    show("parameter view", layer.weight.detach().t())
    made = x + 1
    show("made", made)
    show("view of made", made.t())
    row = x[0]
    row.add_(1)  # a normal tensor's view, updated inside
    show("updated inside", x)
row.add_(1)  # and outside
show("updated outside", x)
try:
    made.add_(1)
except RuntimeError as error:
    print("inference tensor updated outside:", str(error).split(".")[0])
