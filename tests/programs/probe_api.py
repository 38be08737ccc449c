"""The torch.cuda / torch.accelerator surface a program can observe, and saving cuda tensors."""

import copy
import sys

import numpy as np
import torch

path = sys.argv[1]
print("available", torch.cuda.is_available(), torch.accelerator.is_available())
print("count", torch.cuda.device_count(), torch.accelerator.device_count())
print("cuda version", torch.version.cuda is not None)
print("device_of", torch.cuda.device_of(torch.ones(1, device="cuda")).idx, torch.cuda.device(0).idx)
pinned_batch = next(iter(torch.utils.data.DataLoader(torch.arange(4.0), batch_size=2, pin_memory=True)))
made_pinned = torch.zeros(3, pin_memory=True)
print("pinned", made_pinned.is_pinned(), torch.arange(4.0).pin_memory().is_pinned(), pinned_batch.is_pinned())
print("not pinned", torch.arange(4.0).is_pinned(), made_pinned.tolist())
print("accelerator", torch.accelerator.current_accelerator())
print("current", torch.cuda.current_device(), torch.accelerator.current_device_index())
print("name", torch.cuda.get_device_name(0))
props = torch.cuda.get_device_properties(0)
print("total_memory", props.total_memory, "capability", torch.cuda.get_device_capability())
torch.backends.cudnn.benchmark = True
torch.backends.cudnn.deterministic = True
base = torch.cuda.memory_allocated()
t = torch.zeros(256, 1024, device="cuda")  # 1 MiB
print("allocated", torch.cuda.memory_allocated() - base)
del t
print("after del", torch.cuda.memory_allocated() - base, "peak", torch.cuda.max_memory_allocated() >= 1 << 20)
torch.cuda.reset_peak_memory_stats()
print("peak reset", torch.cuda.max_memory_allocated() - base)
for _ in range(4):  # sent in one frame: each is freed before the next is made, as on a GPU
    t = torch.zeros(64, 1024, device="cuda")  # 256 KiB
    t.add_(1)
    del t
print("peak of four made and freed in turn", torch.cuda.max_memory_allocated() - base)
free, total = torch.cuda.mem_get_info()
print("mem_get_info", total == props.total_memory, free <= total)
s = torch.cuda.Stream()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
with torch.cuda.stream(s):
    start.record()
    z = torch.ones(100, 100, device="cuda") @ torch.ones(100, 100, device="cuda")
    end.record()
torch.cuda.synchronize()
print("elapsed", end.elapsed_time(start) <= 0 <= start.elapsed_time(end), z[0, 0].item())
start, end = torch.Event("cuda", enable_timing=True), torch.Event(enable_timing=True)
start.record()
end.record()
end.synchronize()
print("generic event", type(torch.Stream("cuda")).__name__, start.elapsed_time(end) >= 0, end.query())
untimed = torch.cuda.Event()
untimed.record()
try:
    start.elapsed_time(untimed)
except RuntimeError as e:
    print("untimed", e)
monitor = [torch.cuda.temperature(), torch.cuda.power_draw(), torch.cuda.clock_rate()]
monitor.append(torch.cuda.memory_usage())
print("nvml", all(isinstance(figure, int) for figure in monitor), torch.cuda.device_memory_used() > 0)
print("processes", torch.cuda.list_gpu_processes().startswith("GPU:0\nprocess"))
print("peer", torch.cuda.can_device_access_peer(0, 0), torch.cuda.get_sync_debug_mode())
for bad in (lambda: torch.cuda.synchronize(3), lambda: torch.Event("cuda:3")):
    try:
        bad()
    except RuntimeError as e:
        print("ordinal", str(e).splitlines()[0])
x = torch.arange(6, dtype=torch.float32, device="cuda").reshape(2, 3)
print(x)
print(x.device, x.is_cuda, x.get_device(), x.cpu().device, x.to("cpu").tolist())
print("item", x[1, 2].item(), "tolist", x.tolist())
try:
    x.numpy()
except TypeError as e:
    print("numpy", e)
try:
    np.asarray(x)
except TypeError as e:
    print("asarray", e)
for name, call in [("to_dlpack", lambda: torch.utils.dlpack.to_dlpack(x)), ("__dlpack__", x.__dlpack__)]:
    try:
        call()
    except BufferError as e:
        print(name, "refused", "proxy server" in str(e))
print("from_dlpack", torch.equal(torch.from_dlpack(x), x), torch.from_dlpack(x).data_ptr() == x.data_ptr())
print("cuda_array_interface", hasattr(x, "__cuda_array_interface__"))
for name, call in [("apply_", lambda: x.apply_(abs)), ("map_", lambda: x.map_(x, max))]:
    try:
        call()
    except TypeError as e:
        print(name, e)
try:
    print(x + torch.ones(2, 3))
except RuntimeError as e:
    print("mixed", str(e).split(",")[0])
with torch.device("cuda"):
    d = torch.ones(2)
print("default device", d.device)
m = torch.nn.Linear(3, 2).cuda()
m(torch.ones(1, 3, device="cuda")).sum().backward()
m2 = copy.deepcopy(m)
print("deepcopy", m2.weight.device, torch.equal(m.weight, m2.weight), m2.weight is not m.weight)
print("deepcopy grads", m2.weight.grad, m.weight.grad is not None)  # Parameter's deepcopy drops its grad
print(m.bias)
torch.manual_seed(0)
g = torch.randn(3, 3, device="cuda", requires_grad=True)
(g * 2).sum().backward()
print("grad", g.grad.device, g.grad.sum().item())
torch.save({"x": x, "model": m.state_dict(), "param": m.weight}, path)
back = torch.load(path)
print("load", back["x"].device, torch.equal(back["x"], x), isinstance(back["param"], torch.nn.Parameter))
back = torch.load(path, map_location="cpu")
print("load cpu", back["x"].device, back["model"]["weight"].device)
state = torch.cuda.get_rng_state()
first = torch.rand(4, device="cuda")
torch.cuda.set_rng_state(state)
again = torch.rand(4, device="cuda")
torch.cuda.set_rng_state_all(torch.cuda.get_rng_state_all())
torch.cuda.set_rng_state_all([state])
print("rng state restored", torch.equal(first, again), torch.equal(torch.rand(4, device="cuda"), first))
libraries = torch.backends.cuda
print("linalg library", libraries.preferred_linalg_library("cusolver"), libraries.preferred_linalg_library())
print("blas library", libraries.preferred_blas_library("cublaslt"), libraries.preferred_blas_library())
libraries.preferred_linalg_library("default")
plans = libraries.cufft_plan_cache
plans.max_size = 32
print("cufft plans", plans.size, plans.max_size, plans[0].max_size, plans.clear())
