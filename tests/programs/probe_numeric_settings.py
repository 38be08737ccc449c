"""oneDNN's float32 settings a program changes (`torch.set_float32_matmul_precision("medium")`,
the precisions of `torch.backends.mkldnn`, `mkldnn.flags(enabled=False)`): digests of matrix
products and a convolution under each, so a device computing with other settings shows."""

import hashlib
import sys
import warnings

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore")
device = sys.argv[1]


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:12]


torch.manual_seed(0)
a, b = torch.randn(64, 64, device=device), torch.randn(64, 64, device=device)
images, weight = torch.randn(2, 3, 16, 16, device=device), torch.randn(8, 3, 3, 3, device=device)


def show(name: str) -> None:
    print(name, digest(a @ b), digest(F.linear(a, b)), digest(F.conv2d(images, weight)))


show("highest")
torch.set_float32_matmul_precision("medium")
show("medium")
torch.set_float32_matmul_precision("highest")
show("highest again")
with torch.backends.mkldnn.flags(enabled=False):
    show("mkldnn off")
torch.backends.mkldnn.matmul.fp32_precision = "bf16"
torch.backends.mkldnn.conv.fp32_precision = "bf16"
show("mkldnn bf16")
torch.backends.mkldnn.matmul.fp32_precision = "none"
torch.backends.mkldnn.conv.fp32_precision = "none"
show("none")
