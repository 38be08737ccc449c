"""Sparse tensors built on the device from device parts: sparse gradients of `nn.Embedding` with
SparseAdam, `torch.sparse_coo_tensor` and `torch.sparse_csr_tensor` (the server refuses their
unchecked constructors and builds them with the checked ones). On the device, an operator the
server refuses is refused again when called again."""

import sys

import torch
from torch import nn

device = sys.argv[1]
torch.manual_seed(0)
embedding = nn.Embedding(10, 3, sparse=True).to(device)
optimizer = torch.optim.SparseAdam(embedding.parameters(), lr=0.1)
indices = torch.tensor([1, 2, 2, 5], device=device)
for step in range(3):
    optimizer.zero_grad()
    embedding(indices).pow(2).sum().backward()
    optimizer.step()
    grad = embedding.weight.grad.coalesce()
    print("embedding", step, grad.is_sparse, grad.indices().tolist(), round(embedding.weight.sum().item(), 5))
parts = torch.tensor([[0, 1], [1, 0]], device=device), torch.tensor([1.0, 2.0], device=device)
for attempt in range(2):
    print("coo", attempt, torch.sparse_coo_tensor(*parts, (2, 2)).to_dense().tolist())
crow, col, values = (
    torch.tensor([0, 1, 2], device=device),
    torch.tensor([1, 0], device=device),
    torch.tensor([3.0, 4.0], device=device),
)
print("csr", torch.sparse_csr_tensor(crow, col, values, (2, 2)).to_dense().tolist())
for attempt in range(2 if device == "cuda" else 0):
    try:
        torch.ops.aten._reshape_alias(values, [2], [1])
        print("reshape_alias", attempt, "ran")
    except Exception as e:
        print("reshape_alias", attempt, type(e).__name__, str(e)[:40])
