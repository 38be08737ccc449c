"""Three processes of one rank train on one device at once, as three processes share a GPU: the
main process and two workers it starts (forked, or spawned with --start spawn) before it uses
the device each train a model of their own, starting together once both workers use the device;
the main process prints a loss every step and, at the end, what each worker sent it (its last
losses and weights checksum) through a multiprocessing queue of the same start method.

With --hold FILE the main process waits, before its final lines, until FILE exists.
"""

import argparse
import os
import time

import torch
import torch.multiprocessing as mp
from torch import nn


def train(seed: int, steps: int, device: str, show: bool) -> str:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        x = torch.randn(64, 16, device=device)
        loss = nn.functional.mse_loss(model(x), x[:, :1] * x[:, 1:2])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(f"{loss.item():.8f}")
        if show:
            print(f"step {step} loss {losses[-1]}", flush=True)
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    return f"losses {' '.join(losses[-3:])} weights {checksum:.10f}"


def worker(seed: int, steps: int, device: str, report: "mp.Queue[tuple[int, str]]") -> None:
    torch.zeros(1, device=device).sum().item()
    report.put((seed, "ready"))
    report.put((seed, train(seed, steps, device, show=False)))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--start", choices=("fork", "spawn"), default="fork")
    ap.add_argument("--hold", help="before the final lines, wait until this file exists")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    context = mp.get_context(args.start)
    report: "mp.Queue[tuple[int, str]]" = context.Queue()
    workers = [context.Process(target=worker, args=(seed, args.steps, device, report)) for seed in (1, 2)]
    for process in workers:
        process.start()
    assert sorted(report.get(timeout=300) for _ in workers) == [(1, "ready"), (2, "ready")]
    mine = train(0, args.steps, device, show=True)
    sent = dict(report.get(timeout=600) for _ in workers)
    for process in workers:
        process.join()
    while args.hold and not os.path.exists(args.hold):
        time.sleep(0.05)
    print("main", mine, flush=True)
    for seed in sorted(sent):
        print(f"worker {seed}", sent[seed], flush=True)
