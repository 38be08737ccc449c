"""Migration between two real daemons in network namespaces: downtime, total time, bytes sent.

Run (root, CRIU): .venv/bin/python bench/bench_migrate.py [--sizes 100,1024,4096] [--runs 1]
[--modes off,on,base,nopreload,base-nopreload]

Two daemons of a lab (tests/federation/lab.py: each in network and mount namespaces of its own,
joined with the real `sing cluster` verbs, mutual TLS over a veth link) on this one machine, so
both share its cores and disk. A proxied job holds SIZE MiB of device state (random numbers on its
virtual device) and prints a wall-clock tick every 10 ms, each after a round trip to its device.
`sing migrate` moves it from node-a to node-b. Reported per size:

- downtime seen by the program: the longest gap between two ticks around the move;
- downtime seen by the daemons: from the pause of the final checkpoint on the source (its proxies
  park the job: from then on it makes no progress) to the job RUNNING on the target, and its parts
  (stop: device state written, CRIU dump, manifest; transfer; restore frozen; commit until
  running), from the checkpoint's record and the jobs' events on both daemons;
- pre-copy: device state written by the proxies and sent to the target while the job still ran;
- total: `sing migrate` from call to return;
- checkpoint image size against the bytes sent while the job ran and after it stopped;
- the same files copied between the two namespaces over a plain TCP socket in the same run (no TLS,
  no checksums), against the real transfer (gRPC, mutual TLS, sha256 per chunk, verified).

Pre-copy on: node-a's proxies pre-copy the device state (`proxy_pre_copy` = 2 rounds) and the
source sends it to the target while the job runs; after the stop only what changed since, the
process images (CRIU cannot pre-dump here: no memory dirty tracking), logs and record are sent.
Off: `proxy_pre_copy` = 0, everything is written and sent while the job is stopped. Both with
`move_process_base` off. Base: pre-copy on and `move_process_base` on: while the job runs the
source also dumps its processes in place and sends those images as a base, so after the stop the
process images travel as recipes against it plus the blocks it lacks (singularityd/federation/
bases.py). "Sent after the stop" is what the source's transfer after the stop sent (its note).
In modes on and base the target preloads (`move_preload`, its default): as soon as the pre-copied
device state has arrived it is read onto the target's device while the job still runs, and the
restore takes it there. Nopreload and base-nopreload: as on and base with node-b's `move_preload`
off, so its restore reads all the device state (the modes to set beside "on" and "base").
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.federation.lab import Lab, Node, joined_lab  # noqa: E402
from tests.helpers import wait_until  # noqa: E402

PYTHON = sys.executable
PROGRAM = r"""
import os, sys, time, torch
mib, hold = int(sys.argv[1]), sys.argv[2]
state = torch.empty(mib << 18, device="cuda").normal_()
step = torch.zeros(1, device="cuda")
print("ready", flush=True)
while not os.path.exists(hold):
    step += 1
    print(f"tick {time.time():.6f} {step.item():.0f}", flush=True)
    time.sleep(0.01)
print("done", state.sum().item(), flush=True)
"""

RAW_RECEIVE = r"""
import os, socket, sys
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("0.0.0.0", int(sys.argv[1])))
server.listen(1)
print("listening", flush=True)
conn, _ = server.accept()
with open(sys.argv[2], "wb") as out:
    while data := conn.recv(1 << 20):
        out.write(data)
    out.flush()
    os.fsync(out.fileno())
conn.close()
"""
RAW_SEND = r"""
import pathlib, socket, sys, time
files = sorted(p for p in pathlib.Path(sys.argv[3]).rglob("*") if p.is_file())
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])))
start = time.monotonic()
for path in files:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sock.sendall(chunk)
sock.shutdown(socket.SHUT_WR)
sock.recv(1)
print(time.monotonic() - start)
"""
RAW_PORT = 7099


def raw_copy_seconds(lab: Lab, folder: Path) -> float:
    """Seconds to copy the files of `folder` from node-a to a file on node-b over a plain TCP socket
    (read from disk, written and synced to disk as the transfer does; no TLS, no checksums)."""
    out = lab.paths.root / "raw-copy"
    receiver = lab.network.start(
        "node-b", [PYTHON, "-c", RAW_RECEIVE, str(RAW_PORT), str(out)], stdout=subprocess.PIPE
    )
    assert receiver.stdout is not None and receiver.stdout.readline() == b"listening\n"
    address = lab.network.nodes["node-b"].address
    sender = lab.network.command("node-a", [PYTHON, "-c", RAW_SEND, address, str(RAW_PORT), str(folder)])
    done = subprocess.run(sender, capture_output=True, text=True, timeout=600, check=True)
    receiver.wait(60)
    out.unlink()
    return float(done.stdout)


def event_time(events: list[dict[str, Any]], pattern: str) -> tuple[float, str]:
    """When the last event whose reason matches `pattern` happened, and its reason."""
    found = [(float(e["at"]), str(e["reason"])) for e in events if re.search(pattern, e["reason"])]
    if not found:
        raise RuntimeError(f"no event matching {pattern!r} in {[e['reason'] for e in events]}")
    return found[-1]


def ticks(log: str) -> list[float]:
    """The wall-clock times the program printed."""
    return [float(line.split()[1]) for line in log.splitlines() if line.startswith("tick ")]


def watch_sent(node: Node, job: int, stop: threading.Event, seen: dict[str, int]) -> None:
    """Keep the largest transfer size and bytes sent that `sing show` reports during the move."""
    while not stop.is_set():
        shown = node.job(job)
        move = (shown or {}).get("move") or {}
        for key in ("total", "moved", "sent"):
            if isinstance(move.get(key), int):
                seen[key] = max(seen.get(key, 0), move[key])
        time.sleep(0.05)


def measure(lab: Lab, mib: int, program: Path) -> dict[str, float]:
    """One move of a job holding `mib` MiB of device state from node-a to node-b."""
    a, b = lab.node("node-a"), lab.node("node-b")
    hold = lab.paths.root / f"hold-{mib}-{time.time()}"
    submitted = a.sing(
        "submit", "--env", "OMP_NUM_THREADS=1", "--", PYTHON, str(program), str(mib), str(hold)
    )
    assert submitted.code == 0, submitted.err
    job = int(submitted.out)
    wait_until(lambda: len(ticks(a.rank_log(job).read_text() if a.rank_log(job).exists() else "")) > 50, 600)
    seen: dict[str, int] = {}
    pre_sent = 0
    stop = threading.Event()
    watcher = threading.Thread(target=watch_sent, args=(a, job, stop, seen), daemon=True)
    watcher.start()
    started = time.monotonic()
    moved = a.sing("migrate", str(job), "--to", "node-b", timeout=1800)
    total = time.monotonic() - started
    stop.set()
    watcher.join(10)
    assert moved.code == 0, moved.err
    before = len(ticks(b.rank_log(job).read_text()))
    wait_until(lambda: len(ticks(b.rank_log(job).read_text())) > before + 20, 120)
    hold.touch()
    assert b.sing("wait", str(job), timeout=300).code == 0
    times = ticks(b.sing("logs", str(job)).out)
    gap = max(later - earlier for earlier, later in itertools.pairwise(times))
    source_events = a.job(job)["events"]  # type: ignore[index]
    arrived = b.job(job)
    assert arrived is not None
    target_events = arrived["events"]
    checkpoint = arrived["last_checkpoint"]
    paused_at = float(checkpoint["created_at"]) - float(checkpoint["complete_seconds"])
    stopped_at, _ = event_time(source_events, r"^stopped to move to node-b")
    pre = [e for e in source_events if "of pre-copied device state" in e["reason"]]
    pre_seconds, base_sent = 0.0, 0
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if pre:
        found = re.search(r"sent ([0-9.]+)([KMGT]?)i?B? of pre-copied .* in ([0-9.]+)s", pre[-1]["reason"])
        assert found, pre[-1]["reason"]
        pre_sent = int(float(found.group(1)) * units[found.group(2)])
        pre_seconds = float(found.group(3))
        based = re.search(r" and a ([0-9.]+)([KMGT]?) base of its process images", pre[-1]["reason"])
        if based:
            base_sent = int(float(based.group(1)) * units[based.group(2)])
    after = [e["reason"] for e in source_events if " after the stop (" in e["reason"]]
    if after:
        seen["sent"] = int(after[-1].split(" after the stop (")[1].split(" bytes")[0])
    print("  source events:", [e["reason"] for e in source_events][-8:], file=sys.stderr, flush=True)
    print("  target events:", [e["reason"] for e in target_events][-6:], file=sys.stderr, flush=True)
    transferred_at, _ = event_time(source_events, r"^checkpoint transferred")
    restored_at, _ = event_time(target_events, r"^restored frozen")
    preloaded = [str(e["reason"]) for e in target_events if str(e["reason"]).startswith("preloaded ")]
    preload_s = float(preloaded[-1].rsplit(" in ", 1)[1].rstrip("s")) if preloaded else 0.0
    running_at, _ = event_time(target_events, r"the job runs here")
    parts = restore_parts(target_events)
    split = re.search(
        r"staged in ([0-9.]+)s, sent in ([0-9.]+)s, checked by \S+ in ([0-9.]+)s", after[-1] if after else ""
    )
    for key, group in (("staged", 1), ("sending", 2), ("checked", 3)):
        parts[key] = float(split.group(group)) if split else 0.0
    raw = raw_copy_seconds(lab, b.state_dir / "checkpoints" / str(job))
    b.sing("cancel", str(job))
    return {
        "program_downtime": gap,
        "daemon_downtime": running_at - paused_at,
        "stop": stopped_at - paused_at,
        "pre_copy": pre_seconds,
        "transfer": transferred_at - stopped_at,
        "restore": restored_at - transferred_at,
        "commit": running_at - restored_at,
        "total": total,
        "image": float(checkpoint["bytes"]),
        "pre_sent": float(pre_sent + base_sent),
        "sent": float(seen.get("sent", 0)),
        "raw_copy": raw,
        "preload": preload_s,
        **parts,
    }


RESTORE_PARTS = {
    "rebuild": r"images rebuilt in ([0-9.]+)s",
    "placed": r"files placed in ([0-9.]+)s",
    "verify": r"checked the files in ([0-9.]+)s",
    "hashed_mib": r"s \(([0-9.]+)([BKMGT]) read and hashed",
    "device_state": r"device state loaded in ([0-9.]+)s",
    "taken_mib": r"device state loaded in [0-9.]+s \([0-9.]+[BKMGT] read, ([0-9.]+)([BKMGT]) taken preloaded",
    "criu": r"CRIU ([0-9.]+)s",
    "resume": r"proxies resumed in ([0-9.]+)s",
    "awaited": r"checksums awaited ([0-9.]+)s more",
}


def restore_parts(events: list[dict[str, Any]]) -> dict[str, float]:
    """The parts of the target's restore frozen, from its event "restore frozen took ..." (zeros
    when the target does not say)."""
    said = [str(e["reason"]) for e in events if str(e["reason"]).startswith("restore frozen took")]
    text = said[-1] if said else ""
    units = {"B": 1 / (1 << 20), "K": 1 / 1024, "M": 1.0, "G": 1024.0, "T": 1 << 20}
    parts = {}
    for key, pattern in RESTORE_PARTS.items():
        found = re.search(pattern, text)
        value = float(found.group(1)) if found else 0.0
        parts[key] = value * units[found.group(2)] if found and key.endswith("_mib") else value
    return parts


def restart_with(node: Node, **config: Any) -> None:
    """Restart a node's daemon with these config values."""
    node.config.update(config)
    node.kill(signal.SIGTERM)
    node.start()


def main() -> None:
    """Build a two-node lab, move a job of each size, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1024", help="MiB of device state, comma-separated")
    parser.add_argument("--runs", type=int, default=1, help="moves per size (the median is shown)")
    parser.add_argument(
        "--modes",
        default="off,on,base",
        help="pre-copy off, on, on with a process base, and those without the target's preload "
        "(nopreload, base-nopreload)",
    )
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    modes = args.modes.split(",")
    config = {"virtual_devices": 1, "move_timeout_seconds": 1800.0, "move_hold_seconds": 1800.0}
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    with joined_lab(("node-a", "node-b"), f"bmig{os.getpid() % 10000}", config) as lab:
        program = lab.paths.root / "hold_state.py"
        program.write_text(PROGRAM)
        for mode in modes:
            node_a = lab.node("node-a")
            base = mode.startswith("base")
            restart_with(node_a, proxy_pre_copy=0 if mode == "off" else 2, move_process_base=base)
            restart_with(lab.node("node-b"), move_preload=not mode.endswith("nopreload"))
            for mib in sizes:
                for _ in range(args.runs):
                    result = measure(lab, mib, program)
                    print(json.dumps({"mib": mib, "pre_copy_mode": mode, **result}), flush=True)
                    results.setdefault((mode, mib), []).append(result)
    load = os.getloadavg()[0]
    print(f"\n{datetime.now():%Y-%m-%d %H:%M}, load average {load:.1f}, {args.runs} run(s) per size")
    print(
        "| device state | mode | downtime (program) | downtime (daemons) | pre-copy while running "
        "| stop | transfer | restore | commit | total | image | sent while running | sent after the stop "
        "| raw socket copy of the image |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    mb = 1 << 20
    for (mode, mib), runs in sorted(results.items(), key=lambda item: (item[0][1], modes.index(item[0][0]))):
        m = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(
            f"| {mib} MiB | {mode} | {m['program_downtime']:.2f} s | {m['daemon_downtime']:.2f} s | "
            f"{m['pre_copy']:.2f} s | {m['stop']:.2f} s | {m['transfer']:.2f} s | "
            f"{m['restore']:.2f} s | {m['commit']:.2f} s | {m['total']:.2f} s | "
            f"{m['image'] / mb:.0f} MiB | {m['pre_sent'] / mb:.0f} MiB | {m['sent'] / mb:.0f} MiB | "
            f"{m['raw_copy']:.2f} s |"
        )
        rows.append(
            f"| {mib} MiB | {mode} | {m['transfer']:.2f} s | {m['staged']:.2f} s | {m['sending']:.2f} s | "
            f"{m['checked']:.2f} s | {m['restore']:.2f} s | {m['rebuild']:.2f} s | {m['placed']:.2f} s | "
            f"{m['verify']:.2f} s | {m['hashed_mib']:.0f} MiB | {m['device_state']:.2f} s | "
            f"{m['criu']:.2f} s | {m['resume']:.2f} s | {m['awaited']:.2f} s | {m['preload']:.2f} s | "
            f"{m['taken_mib']:.0f} MiB |"
        )
    print(
        "\nThe transfer after the stop (the source's event) and the target's restore frozen (its "
        "event), split:\n"
    )
    print(
        "| device state | mode | transfer | staged | sending | receiver's check | restore frozen "
        "| images rebuilt | files placed | files checked | read and hashed | device state loaded | CRIU "
        "| proxies resumed | checksums awaited after CRIU | preloaded while running | taken preloaded |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
