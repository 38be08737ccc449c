"""The wire codec: values round-trip exactly, nothing but data comes out, frames are bounded."""

from __future__ import annotations

import math
import socket
import struct
import threading
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from singularity.proxy.bootstrap._singularity_proxy import protocol
from singularity.proxy.bootstrap._singularity_proxy.protocol import ProtocolError

NAMES = protocol.torch_names()


def round_trip(value: Any) -> Any:
    """`value` encoded and decoded again, through real JSON bytes."""
    buffers: list[Any] = []
    body = protocol.encode_body(protocol.encode_value(value, buffers))
    return protocol.Frame(protocol.REPLY, body, [memoryview(bytes(b)) for b in buffers]).value()


def same(a: Any, b: Any) -> bool:
    """Equal, with the same types all the way down (NaN equals NaN, -0.0 differs from 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, complex):
        return same(a.real, b.real) and same(a.imag, b.imag)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


plain = st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.complex_numbers()
torch_values = st.sampled_from(
    [*NAMES.dtypes.values(), *NAMES.layouts.values(), *NAMES.memory_formats.values()]
)
values = st.recursive(
    plain | torch_values,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.lists(inner, max_size=5).map(tuple)
        | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(values)
def test_values_round_trip_exactly(value: Any) -> None:
    assert same(round_trip(value), value)


def test_tuple_subclasses_travel_as_tuples() -> None:
    assert same(round_trip(torch.Size([2, 3])), (2, 3))
    assert same(round_trip([torch.Size([1]), (4, [5])]), [(1,), (4, [5])])


def test_every_dtype_layout_and_memory_format_round_trips() -> None:
    for value in [*NAMES.dtypes.values(), *NAMES.layouts.values(), *NAMES.memory_formats.values()]:
        assert round_trip(value) is value


def test_bytes_travel_out_of_band() -> None:
    buffers: list[Any] = []
    body = protocol.encode_body(protocol.encode_value([b"\x00\xff" * 100, "x"], buffers))
    assert b"\xff" not in body and len(buffers) == 1
    assert bytes(round_trip(b"\x00\xff")) == b"\x00\xff"


@pytest.mark.parametrize(
    "value",
    [object(), print, torch.zeros(1), {1: "a"}, {1, 2}, slice(1), type, torch.device("cpu")],
    ids=["object", "function", "tensor", "int-keyed dict", "set", "slice", "class", "device"],
)
def test_only_data_can_be_encoded(value: Any) -> None:
    with pytest.raises(TypeError, match=r"cannot be sent|string keys"):
        protocol.encode_value(value, [])


@pytest.mark.parametrize(
    "tree",
    [
        {"dtype": "no_such_dtype"},
        {"dtype": 3},
        {"layout": "__class__"},
        {"tuple": "abc"},
        {"bytes": 5},
        {"bytes": -1},
        {"complex": [1]},
        {"complex": ["a", 1]},
        {"dict": [1, 2]},
        {"dtype": "float32", "extra": 1},
        {},
        {"__reduce__": ["os", "system"]},
        {"handle": 3},
        {"tensor": ["float32", [1], [1], 0]},
    ],
)
def test_malformed_tags_are_protocol_errors(tree: Any) -> None:
    with pytest.raises(ProtocolError):
        protocol.decode_value([tree], [])


def test_undecodable_bodies_are_protocol_errors() -> None:
    for body in [b"\xff\xfe", b"[1, 2", b"[" * 100_000 + b"]" * 100_000, b"not json"]:
        with pytest.raises(ProtocolError):
            protocol.Frame(protocol.BATCH, body, []).decode()


def test_frames_carry_kind_body_and_buffers() -> None:
    left, right = socket.socketpair()
    with left, right:
        big = bytes(range(256)) * 4096
        sender = threading.Thread(
            target=protocol.send_frame, args=(left, protocol.BATCH, [[1, "a"]], [b"xy", big, memoryview(b"")])
        )
        sender.start()
        frame = protocol.recv_frame(right, protocol.JOB_FRAME_LIMITS)
        sender.join()
        assert frame.kind == protocol.BATCH
        assert frame.decode() == [[1, "a"]]
        assert [bytes(b) for b in frame.buffers] == [b"xy", big, b""]


@pytest.mark.parametrize(
    ("header", "table", "reason"),
    [
        (struct.pack("<BxHI", 2, 0, protocol.MAX_BODY_BYTES + 1), b"", "body"),
        (struct.pack("<BxHI", 2, 0xFFFF, 0), b"", "buffers"),
        (struct.pack("<BxHI", 2, 1, 2), struct.pack("<Q", 1 << 62) + b"[]", "bytes of buffers"),
    ],
)
def test_oversized_frames_are_refused_before_reading_them(header: bytes, table: bytes, reason: str) -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(header + table)
        with pytest.raises(ProtocolError, match=reason):
            protocol.recv_frame(right, protocol.JOB_FRAME_LIMITS)


def test_truncated_frames_end_the_connection() -> None:
    left, right = socket.socketpair()
    with right:
        left.sendall(struct.pack("<BxHI", 2, 0, 100) + b"[1,")
        left.close()
        with pytest.raises(ConnectionError):
            protocol.recv_frame(right, protocol.JOB_FRAME_LIMITS)


def test_host_tensor_bytes_round_trip_and_layouts_are_checked() -> None:
    tensor = torch.arange(12, dtype=torch.float64).reshape(3, 4).t()
    host, raw = protocol.tensor_to_raw(tensor)
    back = protocol.tensor_from_raw("float64", list(host.shape), list(host.stride()), bytearray(raw))
    assert torch.equal(back, tensor) and back.stride() == tensor.stride()
    for shape, stride in [([13], [1]), ([4, 4], [4, 1]), ([2], [100]), ([-1], [1]), ([2], [-1])]:
        with pytest.raises(ProtocolError):
            protocol.tensor_from_raw("float64", shape, stride, bytearray(raw))
    with pytest.raises(ProtocolError):
        protocol.tensor_from_raw("float64", [2, 2], [1], bytearray(raw))
