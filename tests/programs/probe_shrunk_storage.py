"""Operations on tensors whose storage the program resized smaller (FSDP1 frees a flat parameter's
storage so): on a device each is refused with torch's bounds message (the CPU's kernels, which do
not check, may crash the process); after the storage grows back they run again."""

import torch

base = torch.arange(12.0, device="cuda")
view = base.view(3, 4)[1:]
base.untyped_storage().resize_(0)
attempts = {
    "add": lambda: view + 1,
    "sum": lambda: base.sum(),
    "fill": lambda: view.fill_(1.0),
    "copy": lambda: (view.copy_(torch.ones(2, 4)), torch.cuda.synchronize()),  # reported as it ends
    "read": lambda: view.cpu(),
}
for name, attempt in attempts.items():
    try:
        attempt()
        print(name, "ran")
    except RuntimeError as error:
        print(name, str(error).split(" (")[0])
print("storage", base.untyped_storage().nbytes())
base.untyped_storage().resize_(48)
print("regrown", view.fill_(2.0).sum().item(), base.shape)
