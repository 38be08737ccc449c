"""Program errors on the device: printed type and message must match a direct CPU run."""

import sys

import torch

device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
torch.manual_seed(0)
a = torch.randn(4, 3).to(device)
b = torch.randn(5, 2).to(device)


def attempt(name, fn):
    try:
        fn()
        print(name, "no error")
    except Exception as e:  # the point is to print what is raised
        print(name, type(e).__name__, str(e).splitlines()[0])


attempt("mm", lambda: torch.mm(a, b))
attempt("mm-again", lambda: torch.mm(a, b))
attempt("add", lambda: a + torch.ones(4, 4).to(device))
attempt("view", lambda: a.view(7))
attempt("linear", lambda: torch.nn.functional.linear(a, b))
attempt("cat", lambda: torch.cat([a, b]))
attempt("index", lambda: a[torch.tensor([9]).to(device)].sum().item())
print("after", f"{(a @ a.t()).sum().item():.6f}")
