"""Finds, in CRIU's images of a dump, the files sent over a Unix socket and not yet received.

Such a file lives in the socket's queue, in no process's fd table: CRIU reopens it by its path, as
root, at the restore, where the check of what the restored processes hold (reopened.py) cannot see
it. So a dump whose queues carry a file or FIFO reopened by path is refused while the tree is still frozen
(CRIU's post-dump action runs this and lets the tree run on when it fails); a deleted file (CRIU
restores its content from the images) or a socket, pipe or memfd passed along is no such file.

CRIU's images: two magic words, then entries, each a little-endian u32 size and a protobuf
message (a queued packet's bytes follow its entry). The few fields read here, by number:
files.img `file_entry` {type 1, id 2, reg 3 {name 6}, fifo 17 {regf_id 3}} (type 1 a regular
file, 3 a FIFO, whose path is the regular-file entry it names); sk-queues.img `sk_packet_entry`
{length 2, scm 4 {type 1, rights 2}}; remap-fpath.img `remap_file_path_entry` {orig_id 1,
remap_type 3 (1: a ghost, a deleted file whose content the images hold)}; a Unix socket's
file_entry field 16 {name 11, name_dir 14}; core-PID.img `core_entry` {tc 3 {task_state 1}}.
`made_by_name` lists what CRIU makes again by path (bound sockets, ghosts), which the restorer
checks before CRIU runs; `stopped_at_dump` the processes a restore must leave stopped.
Standalone (the standard library only): `python -S image_files.py IMAGES` prints the paths, one
a line, and exits FILES_IN_FLIGHT_EXIT when there are any.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

FILES_IN_FLIGHT_EXIT = 76
SOCKET_QUEUES = "sk-queues.img"
"""The image of what the dumped Unix sockets' queues hold (none when they hold nothing)."""
REGULAR_FILE = 1
FIFO = 3
REGULAR_FILE_FIELD = 3
FIFO_FIELD = 17
UNIX_SOCKET = 5
UNIX_SOCKET_FIELD = 16
GHOST = 1
SCM_RIGHTS = 1
MAGIC_BYTES = 8
TASK_CORE_FIELD = 3
TASK_STOPPED = 3

Fields = dict[int, list[int | bytes]]


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """A protobuf varint at `at`: its value and where the next field starts."""
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, at


def fields(message: bytes) -> Fields:
    """A protobuf message's fields by number, each with its values in order (varints as ints,
    the rest as bytes); ValueError for one that is not a message."""
    found: Fields = {}
    at = 0
    try:
        while at < len(message):
            key, at = _varint(message, at)
            kind = key & 7
            if kind == 0:
                value: int | bytes
                value, at = _varint(message, at)
            elif kind == 2:
                length, at = _varint(message, at)
                value, at = message[at : at + length], at + length
            elif kind in (1, 5):
                width = 8 if kind == 1 else 4
                value, at = message[at : at + width], at + width
            else:
                raise ValueError(f"wire type {kind}")
            found.setdefault(key >> 3, []).append(value)
    except IndexError:
        raise ValueError("a message cut short") from None
    if at != len(message):
        raise ValueError("a message cut short")
    return found


def entries(image: Path, trailing: Callable[[Fields], int] | None = None) -> Iterator[Fields]:
    """The messages of a CRIU image (none if it does not exist); `trailing` says how many bytes
    follow an entry before the next."""
    try:
        data = image.read_bytes()
    except FileNotFoundError:
        return
    at = MAGIC_BYTES
    while at < len(data):
        if at + 4 > len(data):
            raise ValueError(f"{image.name}: an entry cut short")
        (size,) = struct.unpack_from("<I", data, at)
        message = fields(data[at + 4 : at + 4 + size])
        at += 4 + size + (trailing(message) if trailing is not None else 0)
        yield message


def _integers(message: Fields, number: int) -> list[int]:
    """The integer values of a repeated field, packed or not."""
    out: list[int] = []
    for value in message.get(number, []):
        if isinstance(value, int):
            out.append(value)
        else:
            at = 0
            while at < len(value):
                item, at = _varint(value, at)
                out.append(item)
    return out


def files_in_flight(images: Path) -> list[str]:
    """The paths of the files by path (regular files and FIFOs) that the dump's socket queues
    carry, as CRIU would reopen them."""
    sent: list[int] = []
    for packet in entries(images / SOCKET_QUEUES, lambda p: _integers(p, 2)[0]):
        for scm in packet.get(4, []):
            if isinstance(scm, bytes):
                control = fields(scm)
                if _integers(control, 1) == [SCM_RIGHTS]:
                    sent += _integers(control, 2)
    if not sent:
        return []
    remapped = {orig for remap in entries(images / "remap-fpath.img") for orig in _integers(remap, 1)}
    by_id = {ids[0]: entry for entry in entries(images / "files.img") if (ids := _integers(entry, 2))}
    paths = []
    for file_id in dict.fromkeys(sent):
        entry = by_id.get(file_id, {})
        if _integers(entry, 1) == [FIFO]:
            fifo = _message(entry, FIFO_FIELD)
            file_id = (_integers(fifo, 3) or [0])[0]
            entry = by_id.get(file_id, {})
        if _integers(entry, 1) == [REGULAR_FILE] and file_id not in remapped:
            name = _message(entry, REGULAR_FILE_FIELD).get(6, [b""])[0]
            paths.append(name.decode(errors="replace") if isinstance(name, bytes) else str(name))
    return paths


def made_by_name(images: Path) -> list[tuple[str, str]]:
    """(what, path) of each thing CRIU makes again by its path, as root, at the restore: the Unix
    sockets bound to a path (it unlinks what is there, binds, and gives the socket its owner and
    mode) and the deleted files and folders it re-creates beside where they were."""
    ghosts = {
        orig
        for remap in entries(images / "remap-fpath.img")
        if _integers(remap, 3) == [GHOST]
        for orig in _integers(remap, 1)
    }
    made = []
    for entry in entries(images / "files.img"):
        kind, ids = _integers(entry, 1), _integers(entry, 2)
        if kind == [UNIX_SOCKET]:
            socket = _message(entry, UNIX_SOCKET_FIELD)
            name = _text(socket, 11).rstrip("\0")
            if name and not name.startswith("\0"):  # an abstract name is no path
                folder = _text(socket, 14)
                made.append(("a Unix socket bound to", name if name.startswith("/") else f"{folder}/{name}"))
        elif kind == [REGULAR_FILE] and ids and ids[0] in ghosts:
            made.append(
                ("a deleted file or folder re-created beside", _text(_message(entry, REGULAR_FILE_FIELD), 6))
            )
    return made


def stopped_at_dump(images: Path) -> set[int]:
    """The PIDs (as the dumped tree saw them) of the processes that were stopped (SIGSTOP) when
    dumped: a restore that leaves every process stopped must not let these run."""
    stopped = set()
    for core in images.glob("core-*.img"):
        pid = core.name.removeprefix("core-").removesuffix(".img")
        for entry in entries(core):
            if pid.isdigit() and _integers(_message(entry, TASK_CORE_FIELD), 1) == [TASK_STOPPED]:
                stopped.add(int(pid))
    return stopped


def _text(message: Fields, number: int) -> str:
    """A string or bytes field, as text ('' when there is none)."""
    value = message.get(number, [b""])[0]
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _message(message: Fields, number: int) -> Fields:
    """The message in field `number` ({} when there is none)."""
    value = message.get(number, [b""])[0]
    return fields(value) if isinstance(value, bytes) else {}


def main() -> int:
    """Print the files in flight in the images folder given; FILES_IN_FLIGHT_EXIT if any."""
    try:
        paths = files_in_flight(Path(sys.argv[1]))
    except (OSError, ValueError, IndexError) as error:
        print(f"cannot read the images: {error}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return FILES_IN_FLIGHT_EXIT if paths else 0


if __name__ == "__main__":
    sys.exit(main())
