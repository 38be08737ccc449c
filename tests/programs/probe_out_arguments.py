"""`out=` arguments whose shape is not the result's: the operation resizes them (an empty one
silently, as torch recommends), and the program goes on with the new shape, storage size and values."""

import sys

import torch

device = sys.argv[1]
y = torch.arange(9.0, device=device).reshape(3, 3)
for attempt in range(2):  # the second call repeats the first's signature
    out = torch.empty(0, device=device)
    result = torch.add(y, y, out=out)
    print("add", attempt, tuple(out.shape), out.stride(), result is out, out.untyped_storage().nbytes())
    print("add values", (out * 2).sum().item(), out[2].tolist())
values, indices = torch.empty(0, device=device), torch.empty(0, dtype=torch.long, device=device)
torch.max(y, 1, out=(values, indices))  # out arguments named `max` and `max_values`
print("max", tuple(values.shape), tuple(indices.shape), values.tolist(), indices.tolist())
sorted_values, sorted_indices = torch.empty(0, device=device), torch.empty(0, dtype=torch.long, device=device)
ordered = torch.sort(y.flip(1), 1, out=(sorted_values, sorted_indices))
print("sort", [tuple(part.shape) for part in ordered], ordered[0].tolist(), ordered[1].tolist())
joined = torch.empty(0, device=device)
torch.cat([y, y], out=joined)
print("cat", tuple(joined.shape), joined.untyped_storage().nbytes(), joined.sum().item())
product = torch.empty(0, device=device)
torch.mm(y, y, out=product)
print("mm", tuple(product.shape), product.tolist())
