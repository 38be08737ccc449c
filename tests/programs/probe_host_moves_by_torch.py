"""torch's own code moving device tensors to the host, where a program keeps part of its state
there: clipping gradients of a model split between the host and a device, GradScaler unscaling
host gradients, an exponential moving average kept on the host (`AveragedModel(device="cpu")`),
`PackedSequence.cpu()`, `torch.as_tensor(x, device="cpu")`, and RNN lengths given on the device
(which CUDA refuses). Run with `cpu` or `cuda`: both must print the same but the last line."""

import sys

import torch
from torch.nn.utils.rnn import pack_padded_sequence
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

device = sys.argv[1]
torch.manual_seed(0)


def first(values: torch.Tensor) -> list[float]:
    return values.detach().flatten()[:4].tolist()


for foreach in (False, True):
    head = torch.nn.Linear(4, 2).to(device)
    table = torch.nn.Embedding(10, 4)  # kept on the host
    head(table(torch.tensor([1, 2, 3])).to(device)).pow(2).sum().backward()
    norm = torch.nn.utils.clip_grad_norm_([*head.parameters(), *table.parameters()], 0.5, foreach=foreach)
    print("clipped", foreach, norm.item(), first(table.weight.grad[1]), first(head.weight.grad))

scaler = torch.amp.GradScaler("cuda" if device == "cuda" else "cpu", init_scale=1024.0)
head, table = torch.nn.Linear(4, 2).to(device), torch.nn.Embedding(10, 4)
optimizer = torch.optim.SGD([*head.parameters(), *table.parameters()], lr=0.1)
scaler.scale(head(table(torch.tensor([4, 5])).to(device)).pow(2).sum()).backward()
scaler.step(optimizer)
scaler.update()
print("scaled", first(table.weight[4]), first(head.weight), scaler.get_scale())

model = torch.nn.Linear(2, 2).to(device)
average = AveragedModel(model, device=torch.device("cpu"), multi_avg_fn=get_ema_multi_avg_fn(0.5))
for step in range(3):
    with torch.no_grad():
        model.weight.add_(1.0)
    average.update_parameters(model)
    print("average", step, first(average.module.weight), average.module.weight.device.type)

sequences = torch.arange(24.0).reshape(3, 4, 2).to(device)
lengths = torch.tensor([3, 1, 2, 3])
packed = pack_padded_sequence(sequences, lengths, enforce_sorted=False)
moved = packed.cpu()
print("packed", moved.data.device.type, moved.is_cuda, packed.batch_sizes.tolist(), moved.data.sum().item())
print("as_tensor", torch.as_tensor(lengths.to(device), device="cpu").device.type)
try:  # the last line differs: CUDA refuses lengths on the device, the host takes its own
    pack_padded_sequence(sequences, lengths.to(device), enforce_sorted=False)
    print("lengths on", device, "accepted")
except RuntimeError as error:
    print("lengths on", device, "refused:", error)
