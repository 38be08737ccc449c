"""Device tensors and other processes, proxied, as on a GPU: a forked child of a process that used
the device may not use it (torch's own error), a device tensor is not sent to a spawned process
(CUDA IPC is not served: refused, never a silent copy that the two processes change apart), a CPU
copy is, a spawned process uses the device its parent uses, and pickling device tensors (as object
collectives do) brings them back onto the device.
"""

import os
import pickle

import torch
import torch.multiprocessing as mp


def in_child(tensor: torch.Tensor, queue: mp.Queue) -> None:
    queue.put(f"{tensor.device.type} {float(tensor.sum())}")


def on_the_device(queue: mp.Queue) -> None:
    try:
        queue.put(f"used it: {float(torch.ones(2, device='cuda').sum())}")
    except RuntimeError as error:
        queue.put(str(error))


if __name__ == "__main__":
    weights = torch.ones(4, device="cuda")
    pid = os.fork()
    if pid == 0:
        try:
            torch.ones(2, device="cuda")
            print("forked child used the device", flush=True)
        except RuntimeError as error:
            print(f"forked child: {error}", flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    print(f"parent after the fork: {float((weights * 2).sum())}", flush=True)

    mp.set_start_method("spawn")
    queue: mp.Queue = mp.Queue()
    try:
        mp.Process(target=in_child, args=(weights, queue)).start()
        print("spawned with a device tensor", flush=True)
    except RuntimeError as error:
        print(f"spawn with a device tensor: {error}", flush=True)
    child = mp.Process(target=in_child, args=(weights.cpu(), queue))
    child.start()
    print(f"spawned child got: {queue.get(timeout=120)}", flush=True)
    child.join()
    child = mp.Process(target=on_the_device, args=(queue,))
    child.start()
    print(f"spawned child on the device: {queue.get(timeout=120)}", flush=True)
    child.join()

    back = pickle.loads(pickle.dumps({"w": weights * 3}))["w"]
    print(f"pickled: {back.device} {float(back.sum())}", flush=True)
    layer = torch.nn.Linear(2, 2).cuda().to(torch.bfloat16)
    weight = pickle.loads(pickle.dumps(layer)).weight
    same = torch.equal(weight.cpu(), layer.weight.cpu())
    kind = "a parameter" if isinstance(weight, torch.nn.Parameter) else "a tensor"
    shown = f"{kind} on {weight.device}, {weight.dtype}, {weight.requires_grad}, {same}"
    print(f"pickled layer: {shown}", flush=True)
