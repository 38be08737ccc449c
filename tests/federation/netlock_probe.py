"""Run inside a fresh network namespace: dump a process holding a loopback TCP connection (stopping
it), then report as JSON the nftables tables seen, those named from the images, and the deletions.

Usage: netlock_probe.py FOLDER CRIU-ARGV...
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from singularityd.federation import netlock

HOLDER = """
import socket, sys, time
server = socket.socket(); server.bind(("127.0.0.1", 0)); server.listen()
client = socket.create_connection(server.getsockname()); accepted, _ = server.accept()
print("connected", flush=True)
while True:
    time.sleep(1)
"""


def main() -> None:
    """Dump the holder, report what the lock helpers see."""
    folder, criu = Path(sys.argv[1]), sys.argv[2:]
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    images = folder / "images"
    images.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    assert holder.stdout is not None and holder.stdout.readline() == b"connected\n"
    dump = [*criu, "dump", "-t", str(holder.pid), "-D", str(images), "-o", "dump.log", "--shell-job"]
    subprocess.run([*dump, "--tcp-established", "--network-lock", "nftables"], check=True)
    holder.wait(10)
    named = netlock.lock_table_names(folder)
    report: dict[str, list[str] | list[bool]] = {"after_dump": netlock.inet_tables(), "named": named}
    report["deleted"] = [netlock.delete_inet_table(name) for name in named]
    report["deleted_again"] = [netlock.delete_inet_table(name) for name in named]
    report["after_delete"] = netlock.inet_tables()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
