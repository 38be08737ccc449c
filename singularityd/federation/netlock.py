"""Remove the network lock CRIU leaves behind on a node a job has left.

`criu dump --tcp-established --network-lock nftables` that stops the job locks its TCP connections
with an nftables table of its own (`inet CRIU-<pid of the dumped task>`) holding their addresses and
ports, and leaves it in place: the restore is expected on the same node, and it deletes the table.
After a move the restore runs on the peer, so the table stays on the source and silently drops the
packets of any later connection with the same addresses and ports - those of the same job coming
back to this node (a job's ranks talking over loopback, say). Once a job has moved away its lock is
deleted here, over netlink (no `nft` program needed), in the daemon's own network namespace (the
one jobs that share the node's network use; a job with a network of its own takes its lock along).
"""

from __future__ import annotations

import errno
import os
import re
import socket
import struct
from pathlib import Path

NETLINK_NETFILTER = 12
NFNL_SUBSYS_NFTABLES = 10
NFNL_MSG_BATCH_BEGIN = 0x10
NFNL_MSG_BATCH_END = 0x11
NFT_MSG_GETTABLE = 1
NFT_MSG_DELTABLE = 2
NFTA_TABLE_NAME = 1
NFPROTO_INET = 1
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
HEADER = struct.Struct("=IHHII")
NFGEN = struct.Struct("=BBH")


UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
TABLE_NAME_SIZE = 32
"""CRIU writes `inet CRIU-<dump uuid>` into a buffer of this size (the NUL included)."""


def lock_table_names(folder: Path) -> list[str]:
    """The nftables tables CRIU locked the dumps under `folder` with (from each dump's uuid)."""
    names = []
    for inventory in sorted(folder.rglob("inventory.img")):
        found = UUID.search(inventory.read_bytes())
        if found:
            names.append(f"inet CRIU-{found.group().decode()}"[: TABLE_NAME_SIZE - 1].removeprefix("inet "))
    return names


def _align(length: int) -> int:
    return (length + 3) & ~3


def _message(kind: int, flags: int, seq: int, family: int, payload: bytes = b"", res_id: int = 0) -> bytes:
    body = NFGEN.pack(family, 0, socket.htons(res_id)) + payload
    message = HEADER.pack(HEADER.size + len(body), kind, flags, seq, 0) + body
    return message + b"\0" * (_align(len(message)) - len(message))


def _name_attribute(name: str) -> bytes:
    value = name.encode() + b"\0"
    attribute = struct.pack("=HH", 4 + len(value), NFTA_TABLE_NAME) + value
    return attribute + b"\0" * (_align(len(attribute)) - len(attribute))


def _messages(data: bytes) -> list[tuple[int, bytes]]:
    """(type, payload after the netlink header) of each message in a netlink datagram."""
    found = []
    offset = 0
    while offset + HEADER.size <= len(data):
        length, kind, _, _, _ = HEADER.unpack_from(data, offset)
        if length < HEADER.size:
            break
        found.append((kind, data[offset + HEADER.size : offset + length]))
        offset += _align(length)
    return found


def _table_name(payload: bytes) -> str | None:
    offset = NFGEN.size
    while offset + 4 <= len(payload):
        length, kind = struct.unpack_from("=HH", payload, offset)
        if length < 4:
            return None
        if kind & 0x3FFF == NFTA_TABLE_NAME:
            return payload[offset + 4 : offset + length].rstrip(b"\0").decode(errors="replace")
        offset += _align(length)
    return None


def inet_tables() -> list[str]:
    """The names of the `inet` nftables tables of this network namespace."""
    kind = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETTABLE
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER) as sock:
        sock.settimeout(5)
        sock.send(_message(kind, NLM_F_REQUEST | NLM_F_DUMP, 1, NFPROTO_INET))
        names: list[str] = []
        while True:
            for message_type, payload in _messages(sock.recv(65536)):
                if message_type == NLMSG_DONE:
                    return names
                if message_type == NLMSG_ERROR:
                    code = -struct.unpack_from("=i", payload)[0]
                    if code:
                        raise OSError(code, os.strerror(code))
                    return names
                name = _table_name(payload)
                if name is not None:
                    names.append(name)


def delete_inet_table(name: str) -> bool:
    """Delete an `inet` nftables table of this network namespace; False when there is none."""
    delete = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_DELTABLE
    batch = (
        _message(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, 1, 0, res_id=NFNL_SUBSYS_NFTABLES)
        + _message(delete, NLM_F_REQUEST | NLM_F_ACK, 2, NFPROTO_INET, _name_attribute(name))
        + _message(NFNL_MSG_BATCH_END, NLM_F_REQUEST, 3, 0, res_id=NFNL_SUBSYS_NFTABLES)
    )
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER) as sock:
        sock.settimeout(5)
        sock.send(batch)
        for message_type, payload in _messages(sock.recv(65536)):
            if message_type == NLMSG_ERROR:
                code = -struct.unpack_from("=i", payload)[0]
                if code == errno.ENOENT:
                    return False
                if code:
                    raise OSError(code, f"deleting nftables table {name}: {os.strerror(code)}")
                return True
    return True
