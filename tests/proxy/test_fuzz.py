"""A fuzzed stream of hostile frames from one job leaves another job on the same server byte-identical.

While a victim job trains (tests/programs/mlp.py, over and over) on a proxy server, hypothesis
drives an attacker through that server: garbage bytes, frames of every kind with arbitrary
JSON bodies and buffers, and operations (plans and their runs too) with wrong handles, names,
layouts and sizes. Every victim run must print exactly what a direct CPU run prints, and the
server must stay up.
"""

from __future__ import annotations

import itertools
import subprocess
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from singularity.proxy.bootstrap._singularity_proxy import protocol
from tests.proxy.conftest import PROGRAMS, PYTHON, ProxyServer, base_env, proxy_env, start_server, stop_server
from tests.proxy.raw_client import RawSession, values

names = st.sampled_from(
    ["aten", "prims", "os", "c10d", "add", "neg", "mul", "zeros", "empty", "from_file", "_print"]
)
texts = st.text(max_size=12) | names | st.sampled_from(["default", "Tensor", "out", "__class__", "float32"])
numbers = st.integers(min_value=-3, max_value=12) | st.integers() | st.floats()
json_values = st.recursive(
    st.none() | st.booleans() | numbers | texts,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            texts | st.sampled_from(["handle", "tensor", "dtype", "bytes", "tuple"]), inner, max_size=3
        )
    ),
    max_leaves=12,
)
handles = st.integers(min_value=-1, max_value=12) | st.integers(min_value=0, max_value=3) | st.integers()
sizes = st.lists(
    st.integers(min_value=-1, max_value=64) | st.integers(min_value=0, max_value=1 << 40), max_size=3
)
dtypes = st.sampled_from(["float32", "int64", "bool", "complex128", "qint8", "nope"]) | texts
arguments = st.lists(json_values | handles.map(lambda h: {"handle": h}), max_size=4)
kwargs = st.none() | st.dictionaries(texts, json_values, max_size=2)
slots = st.sampled_from([protocol.SLOT_TENSOR, protocol.SLOT_NUMBER, protocol.SLOT_HOST_TENSOR]) | texts
plan_arguments = st.lists(json_values | slots.map(lambda kind: {"slot": kind}), max_size=4)
slot_values = st.lists(handles | numbers | json_values, max_size=4)
plan_ids = st.integers(min_value=0, max_value=3) | handles
op_ids = st.integers(min_value=1, max_value=9) | handles
factories = st.sampled_from(protocol.SERVER_FACTORIES) | texts
operations = st.one_of(
    st.tuples(st.just(protocol.OP_CALL), op_ids, handles, arguments, kwargs),
    st.tuples(st.just(protocol.OP_DEFINE), handles, names | texts, names | texts, texts),
    st.tuples(st.just(protocol.OP_FREE), st.lists(handles, max_size=4)),
    st.tuples(st.just(protocol.OP_UPLOAD), handles, dtypes, sizes, sizes, handles),
    st.tuples(st.just(protocol.OP_ALLOCATE), handles, dtypes, sizes, sizes),
    st.tuples(st.just(protocol.OP_WRITE), handles, numbers, handles),
    st.tuples(st.just(protocol.OP_FILL), handles, dtypes, sizes, sizes, handles),
    st.tuples(
        st.just(protocol.OP_FACTORY),
        handles,
        st.sampled_from(protocol.SERVER_FACTORIES) | texts,
        arguments,
        kwargs,
    ),
    st.tuples(st.just(protocol.OP_PLAN), plan_ids, op_ids, plan_arguments, kwargs),
    st.tuples(st.just(protocol.OP_RUN), plan_ids, handles, slot_values),
    st.lists(json_values, max_size=4).map(tuple),
).map(list)
requests = (
    st.one_of(
        st.tuples(st.just(protocol.REQ_CALL), op_ids, handles, arguments, kwargs),
        st.tuples(st.just(protocol.REQ_FETCH), handles),
        st.tuples(st.sampled_from([protocol.REQ_SYNC, 99])),
        st.tuples(st.just(protocol.REQ_FIGURE), texts | st.sampled_from(protocol.FIGURE_QUERIES)),
        st.tuples(st.just(protocol.REQ_RUN), plan_ids, handles, slot_values),
    ).map(list)
    | json_values
)
kinds = st.sampled_from(sorted(protocol.JOB_MESSAGES)) | st.integers(min_value=0, max_value=255)
buffers = st.lists(st.binary(max_size=64), max_size=3)
frames = st.one_of(
    st.tuples(st.just(protocol.BATCH), st.tuples(st.lists(operations, max_size=6)).map(list), buffers),
    st.tuples(
        st.just(protocol.REQUEST), st.tuples(st.lists(operations, max_size=6), requests).map(list), buffers
    ),
    st.tuples(kinds, json_values, buffers),
)
attacks = st.one_of(
    st.tuples(st.just("frames"), st.lists(frames, min_size=1, max_size=5)),
    st.tuples(st.just("garbage"), st.binary(min_size=1, max_size=64)),
)
SETUP = [
    *([protocol.OP_DEFINE, i, "aten", name, overload] for i, (name, overload) in enumerate(
        [("neg", "default"), ("add", "Tensor"), ("zeros", "default"), ("as_strided", "default"),
         ("resize_", "default"), ("new_empty", "default"), ("view", "default"), ("cat", "default")], start=1
    )),
    *([protocol.OP_UPLOAD, handle, "float32", [4], [1], 0] for handle in (1, 2, 3)),
]  # fmt: skip
"""Operators 1-8 and tensors 1-3 every attacker holds, so that its calls reach real kernels."""


def attack(server: ProxyServer, job: str, kind: str, payload: Any) -> None:
    """One hostile session: garbage bytes, or frames then a sync; the server must answer or hang up."""
    session = RawSession(server.socket, job, timeout=30)
    try:
        assert session.hello().kind == protocol.WELCOME
        session.send(protocol.BATCH, [SETUP], [memoryview(bytes(16))])
        if kind == "garbage":
            session.sock.sendall(payload)
        else:
            for frame_kind, body, buffers in payload:
                session.send(frame_kind, body, buffers)
            session.send(protocol.REQUEST, [[], [protocol.REQ_SYNC]])
        session.sock.shutdown(1)  # no more from us: the server sees the end of what it was sent
        while True:  # answers to any requests among the frames, then to the sync, then the end
            answer = protocol.recv_frame(session.sock)
            assert answer.kind in (protocol.REPLY, protocol.ERROR, protocol.GOODBYE), answer.kind
    except ConnectionError:
        pass
    finally:
        session.close()


pytestmark = pytest.mark.xdist_group("fuzz")  # one server serves the whole module


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyServer]:
    """The server the victim and the attacker share (256 MiB)."""
    server = start_server(tmp_path_factory.mktemp("fuzz"), "shared", memory_bytes=256 << 20)
    yield server
    stop_server(server)


def test_hostile_stream_leaves_another_job_byte_identical(shared_server: ProxyServer) -> None:
    def run(env: dict[str, str]) -> str:
        done = subprocess.run(
            [PYTHON, "mlp.py"], env=env, cwd=PROGRAMS, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    reference = run(base_env())
    outputs: list[str] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def victim() -> None:
        for n in itertools.count():
            try:
                outputs.append(run(proxy_env([shared_server.socket], f"victim-{n}")))
            except BaseException as e:
                failures.append(e)
                return
            if stop.is_set():
                return

    runner = threading.Thread(target=victim)
    runner.start()
    counter = itertools.count()

    @settings(
        max_examples=150,
        deadline=timedelta(seconds=20),
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(attacks)
    def fuzz(case: tuple[str, Any]) -> None:
        attack(shared_server, f"attacker-{next(counter)}", *case)

    try:
        fuzz()
    finally:
        stop.set()
        runner.join(timeout=300)
    assert not failures, failures
    assert outputs and all(output == reference for output in outputs)
    assert shared_server.proc.poll() is None, "the server died"
    session = RawSession(shared_server.socket, "after-fuzz")
    try:
        assert session.hello().kind == protocol.WELCOME
        session.upload(1, torch.arange(3.0))
        assert values(session.fetch(1)).tolist() == [0.0, 1.0, 2.0]
    finally:
        session.close()
