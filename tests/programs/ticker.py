"""A small program whose every line depends on all before it (a hash chain kept in memory).

It prints one line per step; with --steps N it stops after N steps, with --until FILE it stops at
the first step after FILE exists and says how many steps it made. A run stopped after K steps must
print exactly what `ticker.py --steps K` prints: a lost, repeated or reordered step shows.
"""

import argparse
import hashlib
import os
import time

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=None, help="stop after this many steps")
ap.add_argument("--until", help="stop once this file exists")
ap.add_argument("--sleep", type=float, default=0.0, help="seconds between steps")
args = ap.parse_args()
state = hashlib.sha256(b"ticker")
ballast = bytes(range(256)) * (32 << 10)  # 8 MiB the output depends on
step = 0
while (args.steps is None or step < args.steps) and not (args.until and os.path.exists(args.until)):
    state.update(step.to_bytes(8, "little") + ballast[step % len(ballast) : step % len(ballast) + 1])
    print(f"step {step} {state.hexdigest()[:16]}", flush=True)
    step += 1
    time.sleep(args.sleep)
print(f"stopped after {step} steps", flush=True)
