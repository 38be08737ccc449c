"""Wire codec micro-benchmark: encode + decode cost per operation on real proxy messages.

Run: .venv/bin/python bench/bench_wire.py
The messages are recorded from a small-op training run (the MLP of bench_proxy.py) through a
real proxy server, then encoded and decoded here, many times, by each candidate:
- json: the codec in protocol.py (JSON body, tags for non-JSON values, out-of-band buffers),
  decoded the way the server decodes an operation's arguments (tags and handles resolved);
- json + object_hook: the same body, tags decoded by the JSON parser's object hook;
- pickle: the former wire format (tuples, slices for handles, torch dtypes as pickled
  globals) with the class-filtering unpickler the server used.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from singularity.proxy.bootstrap._singularity_proxy import protocol  # noqa: E402
from tests.proxy.conftest import proxy_env, start_server, stop_server  # noqa: E402

RECORD = r"""
import base64, json, sys, time, torch
from torch import nn
from _singularity_proxy import protocol
log = []
send = protocol.send_frame
def record(sock, kind, body, buffers=()):
    if kind in (protocol.BATCH, protocol.REQUEST):
        data = [base64.b64encode(bytes(memoryview(b).cast("B"))).decode() for b in buffers]
        log.append([kind, protocol.encode_body(body).decode(), data])
    send(sock, kind, body, buffers)
protocol.send_frame = record
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).cuda()
opt = torch.optim.SGD(m.parameters(), lr=1e-4)
x = torch.randn(32, 64).cuda()
for i in range(int(sys.argv[2])):
    loss = m(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if i % 10 == 9:
        loss.item()
json.dump(log, open(sys.argv[1], "w"))
"""
"""A small-op training run (the MLP of bench_proxy.py) for argv[2] steps, writing every frame the
job sent to argv[1] (also used by bench_server.py)."""

NAMES = protocol.torch_names()


def record_messages(directory: Path) -> list[tuple[int, str, list[bytes]]]:
    """Frames a small-op training run sends to its proxy server (steady state)."""
    server = start_server(directory, "wire")
    out = directory / "messages.json"
    try:
        command = [sys.executable, "-c", RECORD, str(out), "60"]
        subprocess.run(command, env=proxy_env([server.socket], "wire"), check=True, timeout=600)
    finally:
        stop_server(server)
    recorded = json.loads(out.read_text())
    recorded = recorded[len(recorded) // 3 :]  # the steady state
    return [(kind, body, [base64.b64decode(b) for b in data]) for kind, body, data in recorded]


# -- the former format -----------------------------------------------------------------------------
class _FilteringUnpickler(pickle.Unpickler):
    """The class filter the server used before the JSON codec (plain data, slices, torch dtypes)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in ("slice", "set", "frozenset", "complex"):
            return getattr(__import__("builtins"), name)
        if module == "torch" or module.startswith("torch."):
            found: Any = torch
            for part in name.removeprefix("torch.").split("."):
                found = getattr(found, part, None)
            if found is torch.device or isinstance(found, (torch.dtype, torch.layout, torch.memory_format)):
                return found
        raise pickle.UnpicklingError(f"refused {module}.{name}")


def _to_pickle_form(value: Any, buffers: list[bytes]) -> Any:
    """A JSON-codec value in the former pickled form (slices for handles, objects for tags)."""
    if type(value) is list:
        return [_to_pickle_form(item, buffers) for item in value]
    if type(value) is dict:
        if protocol.TAG_HANDLE in value:
            return slice(value[protocol.TAG_HANDLE])
        if protocol.TAG_HOST_TENSOR in value:
            dtype, shape, stride, index = value[protocol.TAG_HOST_TENSOR]
            return ("t", NAMES.dtype(dtype), tuple(shape), tuple(stride), buffers[index])
        if value == protocol.DEVICE_MARKER:
            return "\x00sing-device"
        if len(value) == 1 and next(iter(value)) in (protocol.TAG_DTYPE, protocol.TAG_MEMORY_FORMAT):
            return protocol.decode_tag(value, buffers)
        return {k: _to_pickle_form(v, buffers) for k, v in value.items()}
    return value


def _resolve_pickled(arg: Any, tensors: dict[int, Any]) -> Any:
    kind = type(arg)
    if kind is slice:
        return tensors.get(arg.stop)
    if kind is list:
        return [_resolve_pickled(item, tensors) for item in arg]
    return arg


def _resolve_json(arg: Any, tensors: dict[int, Any], buffers: list[bytes]) -> Any:
    kind = type(arg)
    if kind is dict:
        handle = arg.get(protocol.TAG_HANDLE)
        if handle is not None:
            return tensors.get(handle)
        if arg == protocol.DEVICE_MARKER:
            return None
        if protocol.TAG_HOST_TENSOR in arg:
            return arg
        return protocol.decode_tag(arg, buffers)
    if kind is list:
        return [_resolve_json(item, tensors, buffers) for item in arg]
    return arg


def _object_hook(tag: dict[str, Any]) -> Any:
    handle = tag.get(protocol.TAG_HANDLE)
    if handle is not None:
        return slice(handle)
    if len(tag) == 1 and next(iter(tag)) in (protocol.TAG_DTYPE, protocol.TAG_MEMORY_FORMAT):
        return protocol.decode_tag(tag, [])
    return tag


def _walk_ops(ops: list[Any], resolve: Callable[[Any], Any]) -> None:
    """Decode the arguments of every call in a batch, as the server does before running it."""
    for op in ops:
        if op[0] == protocol.OP_CALL:
            [resolve(arg) for arg in op[3]]
            if op[4]:
                {k: resolve(v) for k, v in op[4].items()}
        elif op[0] == protocol.OP_RUN:  # slot values: handles and numbers
            [resolve(value) for value in op[3]]


def measure(messages: list[tuple[int, str, list[bytes]]]) -> list[tuple[str, float, float, float]]:
    """(candidate, encode us/op, decode us/op, bytes/op) for each candidate."""
    bodies = [(json.loads(body), buffers) for _kind, body, buffers in messages]
    ops = sum(len(body[0]) + (1 if len(body) > 1 else 0) for body, _ in bodies)
    pickled = [_to_pickle_form(body, buffers) for body, buffers in bodies]
    tensors: dict[int, Any] = {}
    hook_decoder = json.JSONDecoder(object_hook=_object_hook)

    def best(action: Callable[[], object]) -> float:
        times = []
        for _ in range(15):
            start = time.perf_counter()
            action()
            times.append(time.perf_counter() - start)
        return min(times) / ops * 1e6

    json_data = [(protocol.encode_body(body), buffers) for body, buffers in bodies]
    pickle_data = [pickle.dumps(body, pickle.HIGHEST_PROTOCOL) for body in pickled]

    def decode_json() -> None:
        for data, buffers in json_data:
            body = protocol.Frame(protocol.BATCH, data, [memoryview(b) for b in buffers]).decode()
            _walk_ops(body[0], lambda arg, b=buffers: _resolve_json(arg, tensors, b))  # type: ignore[misc]

    def decode_hook() -> None:
        for data, _buffers in json_data:
            body = hook_decoder.decode(data.decode())
            _walk_ops(body[0], lambda arg: _resolve_pickled(arg, tensors))

    def decode_pickle() -> None:
        for data in pickle_data:
            body = _FilteringUnpickler(io.BytesIO(data)).load()
            _walk_ops(body[0], lambda arg: _resolve_pickled(arg, tensors))

    encode_json = best(lambda: [protocol.encode_body(body) for body, _ in bodies])
    encode_pickle = best(lambda: [pickle.dumps(body, pickle.HIGHEST_PROTOCOL) for body in pickled])
    json_bytes = sum(len(d) for d, _ in json_data) / ops
    pickle_bytes = sum(map(len, pickle_data)) / ops
    return [
        ("json (protocol.py)", encode_json, best(decode_json), json_bytes),
        ("json + object_hook", encode_json, best(decode_hook), json_bytes),
        ("pickle + class filter (before)", encode_pickle, best(decode_pickle), pickle_bytes),
    ]


def main() -> None:
    """Print the codec table."""
    with tempfile.TemporaryDirectory() as d:
        messages = record_messages(Path(d))
    rows = measure(messages)
    ops = sum(len(json.loads(body)[0]) for _k, body, _b in messages)
    print(f"{len(messages)} frames, {ops} operations from a small-op training run")
    print(f"{'candidate':<32} {'encode us/op':>12} {'decode us/op':>12} {'total us/op':>12} {'bytes/op':>9}")
    for name, encode, decode, size in rows:
        print(f"{name:<32} {encode:>12.3f} {decode:>12.3f} {encode + decode:>12.3f} {size:>9.1f}")


if __name__ == "__main__":
    main()
