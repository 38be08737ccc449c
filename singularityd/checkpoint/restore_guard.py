"""The restore guard (restore_guard.c): built once by a root daemon and preloaded into CRIU when it
restores another user's job, so every change CRIU makes to the filesystem by name carries that
user's rights, not root's (a folder swapped for a link mid-restore then gains the user nothing)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

SOURCE = Path(__file__).with_name("restore_guard.c")
FOLDER_NAME = "restore-guard"
BUILD_TIMEOUT_S = 120


def build_restore_guard(folder: Path) -> tuple[str, str]:
    """Compile the guard into `folder` (made root-only) unless built already from this source:
    (the library's path, "") or ("", why it could not be built)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return "", "no C compiler (cc) is installed to build it"
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    library = folder / f"restore-guard-{digest}.so"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        if library.is_file():
            return str(library), ""
        partial = folder / f".{library.name}.{os.getpid()}"
        argv = [compiler, "-O2", "-shared", "-fPIC", "-o", str(partial), str(SOURCE), "-ldl"]
        built = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if built.returncode != 0:
            partial.unlink(missing_ok=True)
            last = (built.stderr.strip().splitlines() or [f"exit status {built.returncode}"])[-1]
            return "", f"{compiler} could not build it: {last}"
        os.replace(partial, library)
    except (OSError, subprocess.TimeoutExpired) as error:
        return "", f"it could not be built in {folder}: {error}"
    return str(library), ""


def load_problem(library: str, criu_argv: Sequence[str]) -> str:
    """Why the guard would not be active in this CRIU (it is named otherwise, or ignores
    LD_PRELOAD), or "" when `criu --version` with it preloaded says it is."""
    probe = {
        "SING_RESTORE_GUARD_UID": "65534",
        "SING_RESTORE_GUARD_GID": "65534",
        "SING_RESTORE_GUARD_PROBE": "1",
    }
    try:
        run = subprocess.run(
            [*preloading(library), *criu_argv, "--version"],
            env={**os.environ, **probe},
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"CRIU could not be run with it: {error}"
    if "restore guard: active" not in run.stderr:
        return f"it is not active in {criu_argv[-1]} (CRIU must be a program named criu*, not static)"
    return ""


def preloading(library: str) -> list[str]:
    """The command prefix that runs a program with `library` preloaded (none for ""): through
    env(1), so that a wrapper exec'ing that command (the mount yard's Python) runs without it."""
    return [shutil.which("env") or "/usr/bin/env", f"LD_PRELOAD={library}"] if library else []


def guard_environment(uid: int, gid: int, groups: Sequence[int], places: Sequence[Path]) -> dict[str, str]:
    """The environment that sets the preloaded guard for a job of `uid`; `places` are the
    root-only folders of CRIU's own work (images, logs), where it keeps root's rights."""
    return {
        "SING_RESTORE_GUARD_UID": str(uid),
        "SING_RESTORE_GUARD_GID": str(gid),
        "SING_RESTORE_GUARD_GROUPS": ",".join(str(group) for group in groups),
        "SING_RESTORE_GUARD_PLACES": ":".join(str(place) for place in places),
    }
