"""torch.tensor, torch.as_tensor and torch.asarray of lists holding device scalars (`torch.tensor(losses)`,
as evaluation loops gather them): host tensors of their values, as on a GPU, or device ones when asked."""

import sys

import torch

device = sys.argv[1]
x = torch.arange(6.0, device=device).reshape(2, 3)
losses = [x[0, 0] * 2, x[1, 2], x.sum()]
made = torch.tensor(losses)
print("tensor", made.device.type, made.dtype, made.tolist())
print("nested", torch.tensor([[x[0, 1], 2.0], (x[1, 1], 3)]).tolist())
print("as_tensor", torch.as_tensor(losses).tolist(), torch.as_tensor([x[0, 0]], dtype=torch.float64).dtype)
print(
    "to device",
    torch.tensor(losses, device=device).device.type == device,
    torch.tensor(losses, device=device).sum().item(),
)
print("mean", torch.tensor(losses).mean().item())
print("ints", torch.tensor([torch.tensor(3, device=device), 4]).tolist())
print("plain", torch.tensor([1, 2]).tolist(), torch.tensor(((1.5,),)).tolist())
print("asarray", torch.asarray([x[0, 2]]).tolist())
