"""Hostile jobs against a real proxy server: each attack is refused, costs the attacker at most its
own session, and leaves other sessions and the server untouched."""

from __future__ import annotations

import os
import secrets
import stat
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from singularity.proxy.bootstrap._singularity_proxy import protocol
from singularity.proxy.control import ProxyControl
from tests.proxy.conftest import PROGRAMS, PYTHON, ProxyServer, base_env, proxy_env, start_server, stop_server
from tests.proxy.raw_client import RawSession, error, values

SYNC = [protocol.REQ_SYNC]


pytestmark = pytest.mark.xdist_group("hostile")  # one server serves the whole module


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyServer]:
    """A virtual device with 64 MiB."""
    server = start_server(tmp_path_factory.mktemp("hostile"), "small", memory_bytes=64 << 20)
    yield server
    stop_server(server)


def _allocated(server: ProxyServer) -> int:
    with ProxyControl(server.control) as control:
        return int(control.status()["allocated"])


ATTACK = r"""
import sys, torch
from _singularity_proxy import protocol
from _singularity_proxy.devices import DEVICES
path = sys.argv[1]
channel = DEVICES.channel(0)
handle = channel.new_handle()
call = [protocol.REQ_CALL, 900, handle, [path], {"shared": False, "size": 64, "dtype": {"dtype": "uint8"}}]
channel.pending.append([protocol.OP_DEFINE, 900, "aten", "from_file", "default"])
for attempt in ("first", "again"):
    try:
        print(attempt, "returned", channel.request(call))
    except Exception as e:
        print(attempt, type(e).__name__, e)
try:
    print("fetch returned", channel.request([protocol.REQ_FETCH, handle]))
except Exception as e:
    print("fetch", type(e).__name__, e)
x = torch.ones(3, device="cuda")
print("after", (x + 1).sum().item())
"""


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a root-only file and a job of another user)")
def test_from_file_attack_is_refused_and_the_file_stays_unread(tmp_path: Path) -> None:
    """Issue 7: a job of `nobody` asks the (root) server to run aten::from_file on a root-only file."""
    secret = secrets.token_hex(16)
    target = tmp_path / "secret.txt"
    target.write_text(secret)
    target.chmod(0o600)
    assert target.stat().st_uid == 0
    # the test venv's interpreter may sit where `nobody` cannot reach it (a pyenv under /root)
    python = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    if not Path(python).exists():
        pytest.skip(f"no {python} for a job of another user")
    site_packages = next(p for p in sys.path if p.endswith("site-packages"))
    public = Path(tempfile.mkdtemp(prefix="sing-proxy-"))  # a socket folder `nobody` can reach
    public.chmod(0o711)
    server = start_server(public, "dev0")
    try:
        env = proxy_env([server.socket], "attack")
        env["PYTHONPATH"] += f":{site_packages}"
        job = subprocess.run(
            [python, "-c", ATTACK, str(target)],
            env=env,
            cwd="/",
            user="nobody",
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        stop_server(server)
        for entry in public.iterdir():
            entry.unlink()
        public.rmdir()
    assert job.returncode == 0, job.stderr
    refusal = "aten::from_file.default is not run on proxied devices: it reads or writes files on the server"
    assert f"first PermissionError proxy: {refusal}" in job.stdout
    assert f"again PermissionError proxy: {refusal}" in job.stdout
    assert "fetch ProtocolError proxy: no tensor" in job.stdout
    assert "after 6.0" in job.stdout
    assert secret not in job.stdout + job.stderr
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


def test_sessions_cannot_use_each_others_handles(server: ProxyServer) -> None:
    owner, other = RawSession(server.socket, "owner"), RawSession(server.socket, "intruder")
    try:
        assert owner.hello().kind == protocol.WELCOME and other.hello().kind == protocol.WELCOME
        owner.upload(5, torch.arange(4, dtype=torch.float32))
        assert owner.request([], SYNC).kind == protocol.REPLY
        assert "no tensor 5 in this session" in error(other.fetch(5))
        define = [protocol.OP_DEFINE, 1, "aten", "neg", "default"]
        call = [protocol.REQ_CALL, 1, 10, [{"handle": 5}], None]
        assert "no tensor 5 in this session" in error(other.request([define], call))
        other.send(protocol.BATCH, [[[protocol.OP_FREE, [5]]]])
        other.upload(5, torch.full((2,), 7.0))  # the intruder's own handle 5 is another tensor
        assert values(other.fetch(5)).tolist() == [7.0, 7.0]
        assert values(owner.fetch(5)).tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        owner.close()
        other.close()


def _healthy(server: ProxyServer, job: str) -> None:
    """A fresh session on the server still computes."""
    session = RawSession(server.socket, job)
    try:
        assert session.hello().kind == protocol.WELCOME
        session.upload(1, torch.tensor([1.0, 2.0]))
        define = [protocol.OP_DEFINE, 1, "aten", "mul", "Tensor"]
        template = session.request([define], [protocol.REQ_CALL, 1, 2, [{"handle": 1}, {"handle": 1}], None])
        assert template.kind == protocol.REPLY, template.value()
        assert values(session.fetch(2)).tolist() == [1.0, 4.0]
    finally:
        session.close()


@pytest.mark.parametrize(
    "frame",
    [
        struct.pack("<BxHI", protocol.BATCH, 0, 0xFFFFFFFF),
        struct.pack("<BxHI", protocol.BATCH, 0xFFFF, 2),
        struct.pack("<BxHI", protocol.REQUEST, 1, 2) + struct.pack("<Q", 1 << 60) + b"[]",
    ],
    ids=["body", "buffer count", "buffer bytes"],
)
def test_absurd_frame_lengths_end_only_that_connection(server: ProxyServer, frame: bytes) -> None:
    attacker = RawSession(server.socket, "absurd")
    bystander = RawSession(server.socket, "bystander")
    try:
        assert attacker.hello().kind == protocol.WELCOME and bystander.hello().kind == protocol.WELCOME
        bystander.upload(1, torch.ones(3))
        attacker.sock.sendall(frame)
        goodbye = protocol.recv_frame(attacker.sock)
        assert goodbye.kind == protocol.GOODBYE and "frame too large" in error(goodbye)
        assert attacker.sock.recv(1) == b""
        assert values(bystander.fetch(1)).tolist() == [1.0, 1.0, 1.0]
    finally:
        attacker.close()
        bystander.close()
    _healthy(server, "after-absurd")


def test_truncated_frames_end_only_that_connection(server: ProxyServer) -> None:
    attacker = RawSession(server.socket, "truncated")
    assert attacker.hello().kind == protocol.WELCOME
    attacker.sock.sendall(struct.pack("<BxHI", protocol.REQUEST, 0, 1000) + b"[[],")
    attacker.close()
    garbage = RawSession(server.socket, "garbage")
    garbage.sock.sendall(os.urandom(3))  # not even a header, and no hello
    garbage.close()
    _healthy(server, "after-truncated")


def test_what_the_server_cannot_take_becomes_an_error_in_the_program(server: ProxyServer) -> None:
    job = RawSession(server.socket, "confused")
    try:
        assert job.hello().kind == protocol.WELCOME
        job.upload(1, torch.arange(3.0))
        job.send(99, ["what is this"])
        assert "unknown message kind 99" in error(job.request([], SYNC))
        assert "unknown operation 42" in error(job.request([[42, 1, 2]], SYNC))
        assert "unknown request 7" in error(job.request([], [7]))
        assert "malformed operation" in error(job.request(["not an operation"], SYNC))
        undefined = [protocol.REQ_CALL, 77, 2, [], None]
        assert "operator 77 was not defined" in error(job.request([], undefined))
        define = [protocol.OP_DEFINE, 1, "aten", "neg", "default"]
        odd_tag = [protocol.REQ_CALL, 1, 2, [{"x": 1}], None]
        assert "unknown or malformed tag" in error(job.request([define], odd_tag))
        job.sock.sendall(struct.pack("<BxHI", protocol.REQUEST, 0, 5) + b"[[],]")
        assert "undecodable message body" in error(protocol.recv_frame(job.sock))
        job.send(protocol.BATCH, {"not": "a list"})
        assert "a batch message is [operations]" in error(job.request([], SYNC))
        assert job.request([], SYNC).kind == protocol.REPLY  # the error was reported once
        assert values(job.fetch(1)).tolist() == [0.0, 1.0, 2.0]  # and the session lived on
    finally:
        job.close()


def test_layouts_outside_their_bytes_are_refused(server: ProxyServer) -> None:
    job = RawSession(server.socket, "layouts")
    sixteen = [memoryview(bytes(16))]
    try:
        assert job.hello().kind == protocol.WELCOME
        cases: list[tuple[list[Any], list[memoryview], str]] = [
            ([[protocol.OP_UPLOAD, 1, "float32", [100], [1], 0]], sixteen, "reaches past 16 bytes"),
            ([[protocol.OP_UPLOAD, 2, "float32", [2, 2], [1, 100], 0]], sixteen, "reaches past 16 bytes"),
            ([[protocol.OP_UPLOAD, 3, "float32", [4], [-1], 0]], sixteen, "not an integer"),
            ([[protocol.OP_UPLOAD, 4, "float32", [4], [1], 3]], sixteen, "no buffer 3"),
            (
                [[protocol.OP_ALLOCATE, 5, "float32", [4], [1]], [protocol.OP_WRITE, 5, 8, 0]],
                sixteen,
                "do not fit",
            ),
            ([[protocol.OP_FILL, 5, "float64", [4], [1], 0]], sixteen, "reaches past 16 bytes"),
        ]
        for ops, buffers, message in cases:
            assert message in error(job.request(ops, SYNC, buffers)), ops
        define = [protocol.OP_DEFINE, 1, "aten", "neg", "default"]
        host = {"tensor": ["float64", [3], [1], 0]}
        assert "reaches past 16 bytes" in error(
            job.request([define], [protocol.REQ_CALL, 1, 9, [host], None], sixteen)
        )
        strided = [protocol.OP_DEFINE, 2, "aten", "as_strided", "default"]
        call = [protocol.REQ_CALL, 2, 9, [{"handle": 5}, [100], [1]], None]
        assert "out of bounds for storage" in error(job.request([strided], call))
    finally:
        job.close()


def test_allocations_beyond_the_device_are_refused_before_allocating(small_server: ProxyServer) -> None:
    job = RawSession(small_server.socket, "greedy")
    one_gib = [1 << 28]  # float32
    try:
        assert job.hello().kind == protocol.WELCOME
        factory = [protocol.OP_FACTORY, 1, "zeros", [one_gib], {"device": protocol.DEVICE_MARKER}]
        allocate = [protocol.OP_ALLOCATE, 2, "float32", one_gib, [1]]
        job.upload(3, torch.ones(2))
        define = [protocol.OP_DEFINE, 1, "aten", "new_empty", "default"]
        new_empty = [protocol.REQ_CALL, 1, 4, [{"handle": 3}, one_gib], None]
        for ops, request in (([factory], SYNC), ([allocate], SYNC), ([define], new_empty)):
            refusal = error(job.request(ops, request))
            assert refusal.startswith("OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB"), (
                refusal
            )
            assert _allocated(small_server) == 8  # only the two floats: nothing was allocated
        assert "no tensor 1" in error(job.fetch(1))
    finally:
        job.close()
    _healthy(small_server, "after-greedy")


ISIN = """
import sys, torch
device = sys.argv[1]
x = torch.arange(6, device=device)
print(torch.isin(x, 3).tolist(), torch.isin(x, torch.tensor([1, 4], device=device)).tolist())
print(x.new_zeros(x.shape).tolist(), x.reshape(torch.Size([2, 3])).sum(0).tolist())
"""


def test_torch_size_and_scalars_reach_the_server(server: ProxyServer) -> None:
    """Issue 9: torch.isin(tensor, int) sent a torch.Size the server refused, losing the session."""
    direct = subprocess.run(
        [PYTHON, "-c", ISIN, "cpu"], env=base_env(), capture_output=True, text=True, timeout=120
    )
    proxied = subprocess.run(
        [PYTHON, "-c", ISIN, "cuda"],
        env=proxy_env([server.socket], "isin"),
        cwd=PROGRAMS,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert direct.returncode == 0 and proxied.returncode == 0, proxied.stderr
    assert proxied.stdout == direct.stdout
