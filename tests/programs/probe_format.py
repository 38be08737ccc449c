"""What a program prints of device tensors and asks of their storages, as on a GPU: a 0-dim tensor
formats as its number (f"{loss:.4f}", f"{loss}", "{:+.2f}".format), other tensors as themselves;
share_memory_() is a no-op for device tensors (a module's too) and their storages count as shared.
The lines that name the device say its type only, so a direct CPU run prints the same."""

import sys

import torch

device = sys.argv[1]
loss = torch.tensor(0.123456, device=device)
print(f"loss {loss:.4f} {loss} {loss:>10.2e}|")
print("signed {:+.2f}".format(torch.ones(3, device=device)[0]))  # noqa: UP032 (str.format as such)
print(f"integer {torch.tensor(7, device=device):d} {torch.tensor(7, device=device):04d}")
print(f"flag {torch.tensor(True, device=device)}")
graded = torch.tensor(2.5, device=device, requires_grad=True) * 2
print(f"graded {graded:.3f}")
try:
    print(f"vector {torch.ones(2, device=device):.2f}")
except TypeError as error:
    print("vector TypeError", error)
print(f"vector plain {torch.ones(2, device=device).sum(0, keepdim=True).cpu()}")
parameter = torch.nn.Parameter(torch.tensor(1.5, device=device))
try:
    print(f"parameter {parameter:.2f}")
except TypeError as error:
    print("parameter TypeError", error)

t = torch.ones(3, device=device)
print("share_memory_ returns itself", t.share_memory_() is t)
model = torch.nn.Linear(2, 2).to(device)
print("module share_memory", model.share_memory() is model, model.weight.device.type == device)
if device == "cuda":  # a CPU tensor's storage is shared only after share_memory_()
    print("is_shared", t.is_shared(), t.untyped_storage().is_shared())
    print("storage is_shared", t.storage().is_shared())
else:
    print("is_shared", True, True)
    print("storage is_shared", True)
print("usable after", model(torch.ones(1, 2, device=device)).shape, float(t.sum()))
