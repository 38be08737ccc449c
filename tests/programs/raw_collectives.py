"""Every collective of torch.distributed on the accelerator, launched torchrun-style (RANK etc.).

Each rank prints what it got, so that runs can be compared line by line: all_reduce (sum, avg
and max), broadcast, all_gather, all_gather_into_tensor, reduce_scatter_tensor, reduce, gather,
scatter, all_to_all (single and list), isend/irecv in a ring and a blocking send/recv, the object
collectives, a subgroup made with new_group, functional collectives, a host group's barrier while
another rank waits for a collective on the device, and barrier. `--backend` picks what the program
asks for (default: the accelerator's default backend; "gloo" with cuda tensors also works on a CUDA
machine).
"""

import argparse
import hashlib
import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="")
parser.add_argument("--device", default="cuda", help="cuda, or cpu for a direct run with gloo")
parser.add_argument("--mix", action="store_true", help="gather a host tensor into device tensors")
args = parser.parse_args()

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
local = int(os.environ.get("LOCAL_RANK", rank))
if args.device == "cuda":
    backend = args.backend or dist.get_default_backend_for_device(torch.accelerator.current_accelerator())
    index = local % torch.cuda.device_count()
    torch.cuda.set_device(index)
    device = torch.device("cuda", index)
else:
    backend, device = "gloo", torch.device("cpu")
dist.init_process_group(backend)
if args.mix:
    dist.all_gather([torch.empty(3, device=device) for _ in range(world)], torch.ones(3))


def show(name: str, tensor: torch.Tensor) -> None:
    values = tensor.detach().cpu().contiguous()
    digest = hashlib.sha256(values.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    print(f"rank {rank} {name} {list(values.shape)} {digest} {values.view(-1)[:4].tolist()}", flush=True)


generator = torch.Generator().manual_seed(100 + rank)
base = torch.randn(1000, generator=generator).to(device)

total = base.clone()
dist.all_reduce(total)
show("all_reduce_sum", total)
if backend != "gloo":
    mean = base.clone()
    dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    show("all_reduce_avg", mean)
largest = base.clone()
dist.all_reduce(largest, op=dist.ReduceOp.MAX)
show("all_reduce_max", largest)
for op in (dist.ReduceOp.MIN, dist.ReduceOp.MAX):  # NaN against a number, both ways round
    uneven = base[:4].clone()
    uneven[rank % 2] = float("nan")
    dist.all_reduce(uneven, op=op)
    show(f"all_reduce_{op}_nan", uneven)

shared = base.clone() if rank == world - 1 else torch.zeros(1000, device=device)
dist.broadcast(shared, src=world - 1)
show("broadcast", shared)

pieces = [torch.empty(7, device=device) for _ in range(world)]
dist.all_gather(pieces, base[:7] * (rank + 1))
show("all_gather", torch.cat(pieces))

gathered = torch.empty(world * 5, device=device)
dist.all_gather_into_tensor(gathered, base[:5])
show("all_gather_into_tensor", gathered)

scattered = torch.empty(3, device=device)
dist.reduce_scatter_tensor(scattered, base[: 3 * world].clone())
show("reduce_scatter_tensor", scattered)

reduced = base[:11].clone()
dist.reduce(reduced, dst=0)
if rank == 0:
    show("reduce", reduced)

into = [torch.empty(4, device=device) for _ in range(world)] if rank == 0 else None
dist.gather(base[:4].contiguous(), into, dst=0)
if rank == 0:
    show("gather", torch.cat(into))
part = torch.empty(6, device=device)
dist.scatter(part, [base[:6] + r for r in range(world)] if rank == 0 else None, src=0)
show("scatter", part)

swapped = torch.empty(2 * world, device=device)
dist.all_to_all_single(swapped, torch.arange(2 * world, dtype=torch.float32, device=device) + 100 * rank)
show("all_to_all_single", swapped)
received = [torch.empty(2, device=device) for _ in range(world)]
dist.all_to_all(received, [torch.full((2,), 10.0 * rank + peer, device=device) for peer in range(world)])
show("all_to_all", torch.stack(received))

objects: list[object] = [None] * world
dist.all_gather_object(objects, {"rank": rank, "word": "x" * (rank + 1)})
print(f"rank {rank} all_gather_object {objects}", flush=True)
announced = [f"from {world - 1}", world * 10] if rank == world - 1 else [None, None]
dist.broadcast_object_list(announced, src=world - 1)
print(f"rank {rank} broadcast_object_list {announced}", flush=True)

evens = dist.new_group([r for r in range(world) if r % 2 == 0])
if rank % 2 == 0:
    within = base[:9].clone()
    dist.all_reduce(within, group=evens)
    show("new_group_all_reduce", within)

functional = funcol.all_reduce(base[:8], "sum", dist.group.WORLD)
show("funcol_all_reduce", funcol.wait_tensor(functional))
functional_gather = funcol.all_gather_tensor(base[:2].contiguous(), 0, dist.group.WORLD)
show("funcol_all_gather", funcol.wait_tensor(functional_gather))

outgoing = base[:5] * (rank + 1)
incoming = torch.empty(5, device=device)
ring = [dist.isend(outgoing, dst=(rank + 1) % world), dist.irecv(incoming, src=(rank - 1) % world)]
for request in ring:
    request.wait()
show("isend_irecv_ring", incoming)
if rank == 0:
    dist.send(base[:3].contiguous(), dst=world - 1)
elif rank == world - 1:
    message = torch.empty(3, device=device)
    dist.recv(message, src=0)
    show("send_recv", message)

host_group = dist.new_group(backend="gloo")  # device work is sent before a rank blocks on the host
pending = base[:2].clone()
dist.all_reduce(pending)
if rank == 0:
    dist.barrier(group=host_group)
show("all_reduce_then_host_barrier", pending)
if rank != 0:
    dist.barrier(group=host_group)

dist.barrier()
print(f"rank {rank} done backend={dist.get_backend()}", flush=True)
dist.destroy_process_group()
