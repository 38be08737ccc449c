"""Pipeline-parallel training over point-to-point messages, launched torchrun-style (RANK etc.).

Each rank holds one stage of a model (rank 0 the first); every step, activations go forward with
`dist.send`/`dist.recv`, and gradients come back with `batch_isend_irecv` (a rank also swaps a
small tensor with both neighbours in the same batch, so each batch sends in both directions).
Every rank also passes a value around a ring with `isend` then `recv` (each rank waits for its
left neighbour before its own send completes, as in the ring tutorials) and prints what it got.
Each rank prints per step " step N" with what it received, the last rank its loss; at the end a
checksum of its stage and, from rank 0, `recv_object_list` of what the last rank sent with
`send_object_list`. `--device cpu` runs it directly with gloo, for comparison. With --hold FILE every
rank waits, before its checksum, until FILE exists.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from _common import checksum
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--device", default="cuda", help="cuda (backend nccl), or cpu (backend gloo)")
parser.add_argument("--hold", default="")
options = parser.parse_args()

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if options.device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    dist.init_process_group("nccl")
else:
    dist.init_process_group("gloo")
device = options.device
torch.manual_seed(rank)
stage = nn.Sequential(nn.Linear(16, 16), nn.Tanh()).to(device)
optimizer = torch.optim.SGD(stage.parameters(), lr=0.05, momentum=0.9)
data = torch.Generator().manual_seed(1234)
left, right = rank - 1, rank + 1
ring_left, ring_right = (rank - 1) % world, (rank + 1) % world
for step in range(options.steps):
    x = torch.randn(8, 16, generator=data)
    if rank == 0:
        inputs = x.to(device)
    else:
        inputs = torch.empty(8, 16, device=device)
        dist.recv(inputs, src=left)
        inputs.requires_grad_(True)
    out = stage(inputs)
    if right < world:
        dist.send(out.detach(), dst=right)
        grad = torch.empty_like(out)
    else:
        loss = (out**2).mean()
        loss.backward()
    swap_from_left, swap_from_right = torch.empty(2, device=device), torch.empty(2, device=device)
    mine = torch.full((2,), float(10 * rank + step), device=device)
    ops = []
    if right < world:
        ops += [dist.P2POp(dist.irecv, grad, right), dist.P2POp(dist.isend, mine, right)]
        ops.append(dist.P2POp(dist.irecv, swap_from_right, right))
    if left >= 0:
        ops.append(dist.P2POp(dist.irecv, swap_from_left, left))
    if right < world:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        out.backward(grad)
        ops = []
    if left >= 0:
        ops += [dist.P2POp(dist.isend, inputs.grad, left), dist.P2POp(dist.isend, mine, left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    optimizer.step()
    optimizer.zero_grad()
    token = torch.full((3,), float(rank * 100 + step), device=device)
    got = torch.empty(3, device=device)
    request = dist.isend(token, ring_right)
    dist.recv(got, ring_left)
    request.wait()
    line = f"rank {rank} step {step} ring {got.tolist()}"
    from_left = swap_from_left.tolist() if left >= 0 else None
    from_right = swap_from_right.tolist() if right < world else None
    line += f" swaps {from_left} {from_right}"
    if right == world:
        line += f" loss {loss.item()!r}"
    print(line, flush=True)
if options.hold:
    while not os.path.exists(options.hold):
        time.sleep(0.05)
print(f"rank {rank} checksum {checksum(stage)}", flush=True)
if world > 1:
    if rank == world - 1:
        dist.send_object_list([{"from": rank, "steps": options.steps}], dst=0)
    elif rank == 0:
        received = [None]
        dist.recv_object_list(received, src=world - 1)
        print(f"rank 0 object {received[0]}", flush=True)
dist.destroy_process_group()
