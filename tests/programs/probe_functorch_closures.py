"""torch.func transforms over functions that mix the transformed inputs with other device tensors
(captured ones, buffers, new ones): per-sample gradients, MAML-style inner steps, batched
products; values printed in full."""

import sys

import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

device = sys.argv[1]


class Encoded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.register_buffer("position", torch.arange(12.0).reshape(4, 3) / 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x + self.position[: x.shape[-2]])


def show(name: str, value: torch.Tensor) -> None:
    print(name, [repr(v) for v in value.detach().cpu().flatten().tolist()])


x = torch.arange(6.0, device=device).reshape(2, 3)
w = torch.tensor([1.0, 2.0, 3.0], device=device)
show("vmap captured", vmap(lambda a, b: a * b, in_dims=(0, None))(x, w))
show("vmap dot", vmap(torch.dot, in_dims=(0, None))(x, w))
show("vmap new tensor", vmap(lambda a: a @ torch.ones(3, device=device))(x))
show("grad captured", grad(lambda a: (a * w).sin().sum())(w))
show("jacrev captured", jacrev(lambda a: a * w)(w))

torch.manual_seed(0)
model = Encoded().to(device)
params = {name: value.detach() for name, value in model.named_parameters()}
buffers = {name: value.detach() for name, value in model.named_buffers()}
batch = torch.randn(5, 4, 3, device=device)
targets = torch.randn(5, 4, 3, device=device)


Tensors = dict[str, torch.Tensor]


def loss(p: Tensors, b: Tensors, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (functional_call(model, (p, b), (x.unsqueeze(0),)) - y).pow(2).mean()


per_sample = vmap(grad(loss), in_dims=(None, None, 0, 0))(params, buffers, batch, targets)
show("per-sample grads", per_sample["linear.weight"].sum(0))
show("vmap module", vmap(model)(batch).sum(0))
inner = grad(loss)(params, buffers, batch[0], targets[0])
adapted = {name: value - 0.1 * inner[name] for name, value in params.items()}
show("maml step", grad(loss)(adapted, buffers, batch[1], targets[1])["linear.bias"])
