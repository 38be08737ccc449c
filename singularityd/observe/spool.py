"""The spool directory: a job file (TOML, the fields of `sing submit`) dropped there becomes a job.

The job runs as the file's owner, as the kernel reports it for the opened file (fstat), never as
anything the file says. Only a plain file with one link, written by its owner alone, in a folder
nobody else can tamper with, is accepted. A submitted file is moved to `done/NAME.<id>.toml`; a
refused one stays, with `NAME.toml.error` beside it (one line, readable by the owner only), and
nothing is submitted. A file that names a user (`user = ...` or `uid = ...`) other than its owner
is refused: a job never runs as someone who did not write its file, and the writer learns at once
that the line had no effect.

The folder is one shared directory, mode 1733 like cron's crontabs (anyone may create a file,
nobody but root may list it, the sticky bit keeps users from renaming or removing each other's
files), rather than one folder per user: per-user folders would have to exist before their user
could drop a file, and a user's own folder would let them plant links to files they do not own.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import pwd
import secrets
import shlex
import stat
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from singularityd.errors import RequestError
from singularityd.identity import Caller
from singularityd.jobs.submission import MAX_NAME_CHARS, SubmitArgs, default_gpus
from singularityd.observe.feed import SpoolFileHandled
from singularityd.observe.watch import FolderWatch
from singularityd.store import JobRecord

NAME_MAX_BYTES = 255
"""Longest file name Linux file systems take."""

log = logging.getLogger(__name__)

SPOOL_MODE = 0o1733
USER_MODE_SPOOL_MODE = 0o700
DONE_DIR = "done"
SUFFIX = ".toml"
ERROR_SUFFIX = ".error"
MAX_FILE_BYTES = 64 * 1024
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
FIELDS = (
    "command", "gpus", "ranks", "name", "priority", "env", "cwd", "checkpoint_every", "max_restarts",
    "min_gpus", "max_gpus", "tier", "user", "uid",
)  # fmt: skip


class SpoolRefusal(Exception):
    """A job file that is not submitted; the message is the one line its owner reads."""


@dataclass(frozen=True)
class JobFile:
    """A job file that passed the checks: whose it is and what it asks for."""

    uid: int
    gid: int
    user: str
    args: SubmitArgs


def is_job_file(name: str) -> bool:
    """Whether a folder entry is a job file to read (`NAME.toml`, not hidden)."""
    return name.endswith(SUFFIX) and len(name) > len(SUFFIX) and not name.startswith(".")


def folder_problem(folder: os.stat_result, daemon_uid: int) -> str:
    """Why job files in a folder with this status cannot be trusted ('' when they can)."""
    if folder.st_uid != daemon_uid:
        return f"the spool folder belongs to uid {folder.st_uid}, not to the daemon"
    if folder.st_mode & 0o022 and not folder.st_mode & stat.S_ISVTX:
        return "the spool folder can be written by others and has no sticky bit"
    return ""


def private_group(gid: int, owner: pwd.struct_passwd) -> bool:
    """Whether the group is the owner's alone (a user private group): their primary group, with
    no other member and no other user's primary group."""
    if gid != owner.pw_gid:
        return False
    try:
        members = set(grp.getgrgid(gid).gr_mem)
    except KeyError:
        return False
    if members - {owner.pw_name}:
        return False
    return not any(user.pw_gid == gid and user.pw_uid != owner.pw_uid for user in pwd.getpwall())


def owner_problem(info: os.stat_result, daemon_uid: int) -> str:
    """Why an opened job file cannot be run as its owner ('' when it can).

    Nobody but the owner may have been able to write it: not world-writable, and group-writable
    only for a user private group (umask 002 systems).
    """
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_nlink != 1:
        return f"the file has {info.st_nlink} hard links; drop a file of your own with one link"
    if info.st_size > MAX_FILE_BYTES:
        return f"the file is larger than {MAX_FILE_BYTES // 1024} KiB"
    try:
        owner = pwd.getpwuid(info.st_uid)
    except KeyError:
        return f"the file's owner, uid {info.st_uid}, is not a user of this machine"
    mode = stat.S_IMODE(info.st_mode)
    if mode & stat.S_IWOTH or (mode & stat.S_IWGRP and not private_group(info.st_gid, owner)):
        return f"others may write the file (mode {mode:o}); chmod go-w it"
    if daemon_uid != 0 and info.st_uid != daemon_uid:
        return f"this daemon runs as uid {daemon_uid} and runs jobs of that user only"
    return ""


def _text(data: dict[str, Any], key: str, default: str) -> str:
    value = data.get(key, default)
    if not isinstance(value, str):
        raise SpoolRefusal(f"{key} must be a string")
    return value


def _integer(data: dict[str, Any], key: str, default: int) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpoolRefusal(f"{key} must be a whole number")
    return value


def _command(data: dict[str, Any]) -> tuple[str, ...]:
    """The command: a list of strings, or one string split as a shell would."""
    value = data.get("command")
    if isinstance(value, str):
        try:
            return tuple(shlex.split(value))
        except ValueError as error:
            raise SpoolRefusal(f"command cannot be split into words: {error}") from None
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise SpoolRefusal('command is missing: give command = ["program", "arg", ...]')


def _named_user(data: dict[str, Any], owner: pwd.struct_passwd) -> None:
    """Refuse a file that names a user other than its owner."""
    named = data.get("user", owner.pw_name)
    named_uid = data.get("uid", owner.pw_uid)
    if named != owner.pw_name or named_uid != owner.pw_uid:
        who = named if named != owner.pw_name else f"uid {named_uid}"
        raise SpoolRefusal(
            f"the file names {who}, but a spooled job runs as the file's owner ({owner.pw_name}); "
            "remove the user/uid line"
        )


def job_arguments(text: str, owner: pwd.struct_passwd, default_name: str) -> SubmitArgs:
    """The submission a job file asks for, run as `owner`; SpoolRefusal says what is wrong."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise SpoolRefusal(f"not valid TOML: {error}") from None
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise SpoolRefusal(f"unknown field {unknown[0]!r} (known: {', '.join(FIELDS)})")
    _named_user(data, owner)
    env = data.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise SpoolRefusal('env must be a table of strings, e.g. env = { OMP_NUM_THREADS = "1" }')
    interval = data.get("checkpoint_every")
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int | float)):
        raise SpoolRefusal("checkpoint_every must be a number of seconds")
    base = {
        "HOME": owner.pw_dir,
        "USER": owner.pw_name,
        "LOGNAME": owner.pw_name,
        "SHELL": owner.pw_shell or "/bin/sh",
        "PATH": DEFAULT_PATH,
    }
    ranks = _integer(data, "ranks", 1)
    min_gpus, max_gpus = _integer(data, "min_gpus", 0), _integer(data, "max_gpus", 0)
    return SubmitArgs(
        command=_command(data),
        name=_text(data, "name", default_name),
        gpus=_integer(data, "gpus", default_gpus(ranks, min_gpus, max_gpus)),
        priority=_integer(data, "priority", 0),
        ranks=ranks,
        cwd=_text(data, "cwd", owner.pw_dir),
        env={**base, **env},
        checkpoint_interval=None if interval is None else float(interval),
        max_restarts=_integer(data, "max_restarts", 0),
        min_gpus=min_gpus,
        max_gpus=max_gpus,
        tier=_text(data, "tier", ""),
    )


def read_job_file(folder_fd: int, name: str, daemon_uid: int) -> JobFile:
    """Open a job file in the spool folder and check it; SpoolRefusal says why it is refused.

    The owner is taken from fstat of the opened file (never through a link: O_NOFOLLOW), after
    the folder itself is checked, so what is read is what was checked. FileNotFoundError when
    the file is gone.
    """
    problem = folder_problem(os.fstat(folder_fd), daemon_uid)
    if problem:
        raise SpoolRefusal(problem)
    entry = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
    if stat.S_ISLNK(entry.st_mode):
        raise SpoolRefusal("the file is a symbolic link; drop the file itself")
    if not stat.S_ISREG(entry.st_mode):
        raise SpoolRefusal("not a regular file")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=folder_fd)
    except FileNotFoundError:
        raise
    except OSError as error:
        raise SpoolRefusal(f"cannot open the file: {error.strerror}") from None
    try:
        info = os.fstat(fd)
        problem = owner_problem(info, daemon_uid)
        if problem:
            raise SpoolRefusal(problem)
        data = os.read(fd, MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    owner = pwd.getpwuid(info.st_uid)
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise SpoolRefusal("the file is not UTF-8 text") from None
    args = job_arguments(text, owner, name[: -len(SUFFIX)][:MAX_NAME_CHARS])
    return JobFile(owner.pw_uid, owner.pw_gid, owner.pw_name, args)


class Spool:
    """Watches the spool folder and submits each job file dropped there as its owner."""

    def __init__(
        self,
        folder: Path,
        submit: Callable[[Caller, SubmitArgs], JobRecord],
        report: Callable[[SpoolFileHandled], None],
    ) -> None:
        self.folder = folder
        self.submit = submit
        self.report = report
        self.daemon_uid = os.geteuid()
        self._watch = FolderWatch(folder, self.handle, self._created)
        self._folder_fd: int | None = None
        self._done_fd: int | None = None

    def start(self) -> None:
        """Create the folder if needed, submit the files already there, then watch for new ones.

        OSError or SpoolRefusal when the folder cannot be used (the daemon runs on without it).
        """
        mode = SPOOL_MODE if self.daemon_uid == 0 else USER_MODE_SPOOL_MODE
        with contextlib.suppress(FileExistsError):
            self.folder.mkdir(parents=True)
            os.chmod(self.folder, mode)
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = self._folder_fd = os.open(self.folder, flags)
        problem = folder_problem(os.fstat(fd), self.daemon_uid)
        if problem:
            raise SpoolRefusal(problem)
        with contextlib.suppress(FileExistsError):
            os.mkdir(DONE_DIR, 0o711, dir_fd=fd)
        # Submitted files are moved into done/ by root: it must be the daemon's own folder, never
        # a link or a folder a user made (the sticky spool lets anyone create entries).
        done = self._done_fd = os.open(DONE_DIR, flags, dir_fd=fd)
        info = os.fstat(done)
        if info.st_uid != self.daemon_uid or info.st_mode & 0o022:
            raise SpoolRefusal(f"{self.folder / DONE_DIR} must belong to the daemon, writable by it alone")
        self._watch.start()
        for name in sorted(os.listdir(fd)):
            self.handle(name)

    def stop(self) -> None:
        """Stop watching the folder."""
        self._watch.stop()
        for fd in (self._folder_fd, self._done_fd):
            if fd is not None:
                os.close(fd)
        self._folder_fd = self._done_fd = None

    def _created(self, name: str) -> None:
        """A new entry: a link (symbolic or hard) or anything but a plain file is refused at once;
        a new plain file is read once it is written and closed."""
        fd = self._folder_fd
        if fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            entry = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if not stat.S_ISREG(entry.st_mode) or entry.st_nlink > 1:
                self.handle(name)

    def handle(self, name: str) -> None:
        """Submit the job file `name`, or refuse it with an error file beside it."""
        fd = self._folder_fd
        if fd is None or not is_job_file(name):
            return
        try:
            before = os.stat(name, dir_fd=fd, follow_symlinks=False)
            job_file = read_job_file(fd, name, self.daemon_uid)
            # A spooled submission asks for nothing that admin rights allow.
            caller = Caller(job_file.uid, job_file.user, job_file.gid, admin_group="")
            job = self.submit(caller, job_file.args)
        except FileNotFoundError:
            return  # already handled (several events for one file), or taken back
        except (SpoolRefusal, RequestError) as error:
            reason = str(error)
            log.warning("spool: refused %s (uid %d): %s", name, before.st_uid, reason)
            self._write_error(name, before, reason)
            self.report(SpoolFileHandled(name, None, reason))
            return
        log.info("spool: %s from %s submitted as job %d", name, job_file.user, job.id)
        self.report(SpoolFileHandled(name, job.id))
        self._move_done(name, before, job.id)

    def _move_done(self, name: str, before: os.stat_result, job_id: int) -> None:
        """Move a submitted file to done/NAME.<id>.toml (unless its owner replaced it meanwhile)."""
        fd, done = self._folder_fd, self._done_fd
        assert fd is not None and done is not None
        with contextlib.suppress(OSError):  # absent, or a name too long to have one
            os.unlink(name + ERROR_SUFFIX, dir_fd=fd)
        try:
            now = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino):
                return  # a new file under the same name: it gets its own turn
            moved = done_name(name, job_id)
            os.rename(name, moved, src_dir_fd=fd, dst_dir_fd=done)
            kept = os.open(moved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=done)
            try:
                os.fchmod(kept, 0o600)  # it may hold the job's environment: its owner's alone
            finally:
                os.close(kept)
        except OSError as error:
            log.error("spool: job %d submitted, but %s could not be moved aside: %s", job_id, name, error)

    def _write_error(self, name: str, owner: os.stat_result, reason: str) -> None:
        """Put NAME.toml.error beside the file: one line, owned by the file's owner, mode 0600.

        Written under a fresh hidden name and renamed into place, so a link planted under the
        error file's name is replaced, never followed.
        """
        fd = self._folder_fd
        assert fd is not None
        temporary = f".{name}.{secrets.token_hex(8)}{ERROR_SUFFIX}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            out = os.open(temporary, flags, 0o600, dir_fd=fd)
            try:
                os.write(out, f"{name}: {reason}\n".encode())
                if self.daemon_uid == 0:
                    os.fchown(out, owner.st_uid, owner.st_gid)
            finally:
                os.close(out)
            os.rename(temporary, name + ERROR_SUFFIX, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError as error:
            log.error("spool: cannot write the error file of %s: %s", name, error)
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=fd)


def done_name(name: str, job_id: int) -> str:
    """NAME.<id>.toml for a submitted NAME.toml, NAME shortened to keep within a file name's
    255 bytes (a name that did not fit stayed behind and was submitted again at every start)."""
    stem, tail = name[: -len(SUFFIX)], f".{job_id}{SUFFIX}"
    room = NAME_MAX_BYTES - len(tail.encode())
    return stem.encode()[:room].decode(errors="ignore") + tail
