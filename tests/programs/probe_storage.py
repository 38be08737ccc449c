"""What a program learns of tensors' storages: addresses and sizes (as safetensors and Hugging Face
use them to find tied weights before saving), printed as relations that do not depend on where the
memory is, so that a run on the CPU and a run on a device print the same."""

import itertools
import sys
from collections import defaultdict

import torch
from torch import nn

device = sys.argv[1]
a = torch.arange(12.0, device=device).reshape(3, 4)
row = a[1]
print("row offset", row.data_ptr() - a.data_ptr(), "end", a.view(-1)[-1].data_ptr() - a.data_ptr())
print("same storage", row.untyped_storage().data_ptr() == a.untyped_storage().data_ptr())
print("storage bytes", a.untyped_storage().nbytes(), row.untyped_storage().nbytes())
print("typed", a.storage().size(), row.storage().size(), a.storage().element_size(), a.storage().dtype)
print("split", [part.data_ptr() - a.data_ptr() for part in a.split(1)])
print("transposed", a.t().data_ptr() == a.data_ptr(), "detached", a.detach().data_ptr() == a.data_ptr())
b = torch.zeros(1000, device=device)
c = b.clone()
spans = sorted((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in (a, b, c))
print("apart", all(start + size <= after for (start, size), (after, _) in itertools.pairwise(spans)))
print("nonzero", all(start != 0 for start, _ in spans))


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight, as language models do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.other = nn.Linear(4, 4)


model = Tied().to(device)
groups: dict[tuple[int, int], list[str]] = defaultdict(list)
for name, tensor in model.state_dict().items():
    storage = tensor.untyped_storage()
    groups[(storage.data_ptr(), storage.nbytes())].append(name)
print("shared", sorted(sorted(names) for names in groups.values()))
weight = model.other.weight
complete = weight.data_ptr() == weight.untyped_storage().data_ptr()
print("complete", complete and weight.nelement() * weight.element_size() == weight.untyped_storage().nbytes())
