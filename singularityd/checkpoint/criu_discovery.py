"""Finding a usable CRIU: which command, its version, and what it can do on this machine and kernel.

The checks run a few quick subprocesses and read the kernel release: call `locate_criu` once at
start-up (through `asyncio.to_thread` from the daemon's event loop).
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from singularityd.checkpoint.errors import CheckpointUnavailable

MIN_VERSION = (4, 0)
TCP_FIXED_VERSION = (4, 2)
KERNEL_RESTRICTS_PASSCRED = (6, 16)


@dataclass(frozen=True)
class CriuInfo:
    """A CRIU that passed `criu check`, how to run it, and what it can do on this machine."""

    argv: tuple[str, ...]
    version: tuple[int, ...]
    source: str
    dirty_tracking: bool
    dirty_tracking_reason: str = ""
    tcp_problem: str = ""
    network_lock: str = "iptables"
    restore_guard: str = ""
    """The built restore guard (checkpoint.restore_guard) preloaded into restores of other users' jobs."""
    restore_guard_problem: str = ""
    """Why a root daemon has no restore guard, if it has none."""

    @property
    def version_text(self) -> str:
        """The version as CRIU prints it (e.g. "4.2.1")."""
        return dotted(self.version)


def dotted(version: Sequence[int]) -> str:
    """A version as CRIU prints it: (4, 2, 1) -> "4.2.1"."""
    return ".".join(map(str, version))


def parse_version(text: str) -> tuple[int, ...] | None:
    """The version in `criu --version` output ("Version: 4.1.1" -> (4, 1, 1)), if any."""
    m = re.search(r"Version:\s*(\d+(?:\.\d+)*)", text)
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def parse_kernel_release(release: str) -> tuple[int, int]:
    """(major, minor) of a kernel release string such as "6.18.44-fc"."""
    m = re.match(r"(\d+)\.(\d+)", release)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def tcp_problem(criu_version: Sequence[int], kernel: tuple[int, int]) -> str:
    """Why TCP sockets cannot be dumped with this CRIU on this kernel ("" when they can)."""
    if tuple(criu_version[:2]) < TCP_FIXED_VERSION and kernel >= KERNEL_RESTRICTS_PASSCRED:
        return (
            f"CRIU {dotted(criu_version)} cannot dump TCP sockets on Linux "
            f"{kernel[0]}.{kernel[1]} (SO_PASSCRED is refused on inet sockets since 6.16); "
            "CRIU 4.2 or newer is needed"
        )
    return ""


def privilege_problem(euid: int) -> str:
    """Why checkpoints cannot work for a daemon with this effective uid ("" when they can)."""
    if euid != 0:
        return (
            f"the daemon runs as uid {euid} (user mode): CRIU needs root, jobs have no PID "
            "namespace, and CRIU's unprivileged mode needs file capabilities on its binary; "
            "checkpoints are unavailable"
        )
    return ""


def _run_sync(argv: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def probe_criu(argv: Sequence[str], source: str) -> CriuInfo | str:
    """Check one CRIU command: a CriuInfo when it is usable, else the reason it is not."""
    try:
        ver = _run_sync([*argv, "--version"])
    except (OSError, subprocess.SubprocessError) as e:
        return f"{source}: cannot run {argv[-1]}: {e}"
    version = parse_version(ver.stdout + ver.stderr)
    if version is None:
        return f"{source}: {argv[-1]} --version printed no version"
    if version[:2] < MIN_VERSION:
        return f"{source}: CRIU {dotted(version)} is older than 4.0"
    check = _run_sync([*argv, "check"])
    if check.returncode != 0:
        last = (check.stderr or check.stdout).strip().splitlines()
        return f"{source}: `criu check` failed: {last[-1] if last else check.returncode}"
    dirty = _run_sync([*argv, "check", "--feature", "mem_dirty_track"])
    dirty_ok = dirty.returncode == 0
    if shutil.which("iptables-restore"):
        lock = "iptables"
    else:
        nft = _run_sync([*argv, "check", "--feature", "network_lock_nftables"])
        lock = "nftables" if nft.returncode == 0 else "iptables"
    return CriuInfo(
        argv=tuple(argv),
        version=version,
        source=source,
        dirty_tracking=dirty_ok,
        dirty_tracking_reason=""
        if dirty_ok
        else "the kernel has no memory dirty tracking (CONFIG_MEM_SOFT_DIRTY), so CRIU cannot "
        "pre-dump; every checkpoint is a full dump",
        tcp_problem=tcp_problem(version, parse_kernel_release(platform.release())),
        network_lock=lock,
    )


def locate_criu(
    setting: str = "auto", *, prefix: str | os.PathLike[str] = sys.prefix, euid: int | None = None
) -> CriuInfo:
    """Find the CRIU to use, or raise CheckpointUnavailable with every reason it found.

    `setting` is the config value: "auto" tries a `criu` on PATH (if `criu check` passes and it is
    version 4 or newer), then `<prefix>/criu/criu` (the private install of scripts/install-criu);
    "off" disables checkpoints; anything else is the path of the CRIU to run.
    """
    problem = privilege_problem(os.geteuid() if euid is None else euid)
    if problem:
        raise CheckpointUnavailable(problem)
    if setting in ("off", "none", "disabled"):
        raise CheckpointUnavailable("checkpoints are turned off in the configuration")
    candidates: list[tuple[str, str]] = []
    if setting == "auto":
        on_path = shutil.which("criu")
        if on_path:
            candidates.append((on_path, "criu on PATH"))
        candidates.append((str(Path(prefix) / "criu" / "criu"), "private CRIU install"))
    else:
        candidates.append((setting, "configured CRIU"))
    reasons: list[str] = []
    for path, source in candidates:
        if not os.access(path, os.X_OK):
            reasons.append(f"{source}: {path} is not an executable file")
            continue
        found = probe_criu([path], source)
        if isinstance(found, CriuInfo):
            return found
        reasons.append(found)
    raise CheckpointUnavailable("no usable CRIU: " + "; ".join(reasons))
