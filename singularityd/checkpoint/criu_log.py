"""What CRIU's logs say: the patterns the daemon acts on, and one line that says why CRIU failed."""

from __future__ import annotations

from pathlib import Path

FORK_RETRY_PATTERN = "Can't fork for"
PARASITE_PROC_DIR = "proc.crtools"
"""The directory CRIU's parasite makes, in the working directory of the init of a job whose PID
namespace has no /proc of its own, to mount one there for the dump (then it removes it)."""
PARASITE_PROC_CLASH = "Can't create a directory (-17)"
EXITING_WITH_THREADS = "Zombies with threads are not supported"
"""CRIU's refusal of a process whose main thread has ended while others have not: one that is
ending (its threads are torn down one by one), or whose main thread called pthread_exit."""

ERROR_HINTS: tuple[tuple[str, str], ...] = (
    ("No space left on device", "no space left on the device that holds the images"),
    (
        "Can't get 1:16 opt",
        "this CRIU cannot dump TCP sockets on Linux 6.16 or newer: CRIU 4.2 or newer is needed",
    ),
    ("anon_inode:[io_uring]", "a job process uses io_uring, which CRIU cannot checkpoint"),
    (
        "External socket is used",
        "a job process holds a Unix socket connected outside the job: name it as external",
    ),
    (
        "half of stream unix connection",
        "a job process holds a Unix socket connected outside the job: name it as external",
    ),
    (
        "doesn't belong to it",
        "the init of the job's PID namespace must run as root for CRIU to dump it",
    ),
    (
        "Can't get rlimit",
        "CRIU cannot read another user's process limits without CAP_SYS_RESOURCE",
    ),
    ("Iptables configuration failed", "network locking with iptables failed"),
    ("Tracking memory is not available", "the kernel has no memory dirty tracking"),
    ("In-flight connection", "a listening socket has a connection not yet accepted"),
    (
        "on restore: Permission denied",
        "a file the job held is not its user's to open by its path now (a folder on the way "
        "replaced by a link since the checkpoint?)",
    ),
    (
        "Can't unlink socket",
        "a path the job had bound holds something its user may not remove (a folder on the way "
        "replaced since the checkpoint?)",
    ),
    ("Address already in use", "an address the job had bound is in use (is the job running?)"),
    (FORK_RETRY_PATTERN, "a PID that the images need is still taken"),
    (
        PARASITE_PROC_CLASH,
        f"CRIU's {PARASITE_PROC_DIR} directory in the working directory of the job's init stayed taken",
    ),
    (
        EXITING_WITH_THREADS,
        "a job process's main thread had ended while its other threads ran on, through every try",
    ),
)
NOISE = ("rlimit: Can't setup RLIMIT_NOFILE",)
NO_ERROR_LINE = "CRIU failed without an error line in its log"


def summarize_log(text: str) -> str:
    """One line that says why CRIU failed: a hint for a known cause, else its first real error."""
    errors = [
        line.split("): ", 1)[-1].strip()
        for line in text.splitlines()
        if "Error (" in line and not any(n in line for n in NOISE)
    ]
    for pattern, hint in ERROR_HINTS:
        if pattern in text:
            first = next((e for e in errors if pattern in e), errors[0] if errors else "")
            return f"{hint} ({first})" if first and first != hint else hint
    if errors:
        return errors[0]
    return NO_ERROR_LINE


def read_log(path: Path) -> str:
    """The text of a CRIU log ("" when it cannot be read)."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
