"""A spawned worker trains on the device, sends its result and exits, and at the very end of its
exit (after the device client has ended its connection) waits until DIR/go exists, having made
DIR/lingering: a checkpoint then finds a process that holds a connection whose server side has
ended. The main process trains too and prints its losses and both results.

Usage: exiting_worker.py DIR (a direct run passes a DIR holding `go` already).
"""

import atexit
import multiprocessing
import os
import sys
import time


def linger_at_exit() -> None:
    """In a worker, the last exit handler to run: wait for DIR/go."""
    folder = os.environ.get("LINGER_DIR")
    if multiprocessing.parent_process() is None or not folder:
        return
    open(os.path.join(folder, "lingering"), "w").close()
    while not os.path.exists(os.path.join(folder, "go")):
        time.sleep(0.05)


atexit.register(linger_at_exit)  # before torch: exit handlers run last registered first

import torch  # noqa: E402
from shared_device import train  # noqa: E402


def worker(device: str, report: "multiprocessing.Queue[str]") -> None:
    report.put(train(1, 50, device, show=False))


if __name__ == "__main__":
    os.environ["LINGER_DIR"] = sys.argv[1]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spawn = multiprocessing.get_context("spawn")
    report: "multiprocessing.Queue[str]" = spawn.Queue()
    child = spawn.Process(target=worker, args=(device, report))
    child.start()
    mine = train(0, 50, device, show=True)
    sent = report.get(timeout=600)
    child.join()
    print("main", mine, flush=True)
    print("worker", sent, flush=True)
