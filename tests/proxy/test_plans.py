"""Plans (OP_PLAN, OP_RUN, REQ_RUN) as a job that is not the in-job client sends them."""

from __future__ import annotations

from typing import Any

import torch

from singularity.proxy.bootstrap._singularity_proxy import protocol
from tests.proxy.conftest import ProxyServer
from tests.proxy.raw_client import RawSession, error, values

SYNC = [protocol.REQ_SYNC]
TENSOR = {protocol.TAG_SLOT: protocol.SLOT_TENSOR}
NUMBER = {protocol.TAG_SLOT: protocol.SLOT_NUMBER}
HOST = {protocol.TAG_SLOT: protocol.SLOT_HOST_TENSOR}
ADD = [protocol.OP_DEFINE, 1, "aten", "add", "Tensor"]
CAT = [protocol.OP_DEFINE, 2, "aten", "cat", "default"]


def test_a_plan_runs_again_with_new_values(server: ProxyServer) -> None:
    job = RawSession(server.socket, "plans")
    try:
        assert job.hello().kind == protocol.WELCOME
        job.upload(1, torch.arange(3.0))
        job.upload(2, torch.full((3,), 10.0))
        plan = [protocol.OP_PLAN, 0, 1, [TENSOR, TENSOR], {"alpha": NUMBER}]
        first = job.request([ADD, plan], [protocol.REQ_RUN, 0, 3, [1, 2, 0.5]])
        assert first.kind == protocol.REPLY and first.value()[0] == protocol.TEMPLATE_TENSOR
        job.send(protocol.BATCH, [[[protocol.OP_RUN, 0, 4, [3, 1, 2.0]]]])  # (t1 + t2/2) + 2 t1
        assert values(job.fetch(4)).tolist() == [5.0, 8.0, 11.0]
        # lists of tensors: each is a slot of its own, in order
        job.send(protocol.BATCH, [[CAT, [protocol.OP_PLAN, 1, 2, [[TENSOR, TENSOR, TENSOR]], None]]])
        job.send(protocol.BATCH, [[[protocol.OP_RUN, 1, 5, [2, 1, 4]]]])
        assert values(job.fetch(5)).tolist() == [10.0] * 3 + [0.0, 1.0, 2.0] + [5.0, 8.0, 11.0]
        # a host tensor slot: its bytes travel as a buffer
        plan = [protocol.OP_PLAN, 2, 1, [TENSOR, HOST], None]
        host = [["float32", [3], [1], 0]]
        job.send(protocol.BATCH, [[plan, [protocol.OP_RUN, 2, 6, [1, *host]]]], [memoryview(bytes(12))])
        assert values(job.fetch(6)).tolist() == [0.0, 1.0, 2.0]
        # planned again: the id stands for the new call
        job.send(protocol.BATCH, [[[protocol.OP_PLAN, 0, 1, [TENSOR, TENSOR], None]]])
        job.send(protocol.BATCH, [[[protocol.OP_RUN, 0, 7, [2, 2]]]])
        assert values(job.fetch(7)).tolist() == [20.0] * 3
    finally:
        job.close()


def test_malformed_plans_and_runs_become_errors_in_the_program(server: ProxyServer) -> None:
    job = RawSession(server.socket, "bad-plans")
    try:
        assert job.hello().kind == protocol.WELCOME
        job.upload(1, torch.arange(3.0))
        plan = [protocol.OP_PLAN, 0, 1, [TENSOR, TENSOR], None]
        assert job.request([ADD, plan], SYNC).kind == protocol.REPLY
        cases: list[tuple[list[Any], str]] = [
            ([protocol.OP_RUN, 9, 2, [1, 1]], "plan 9 was not made"),
            ([protocol.OP_RUN, 0, 2, [1]], "gives 2 values"),
            ([protocol.OP_RUN, 0, 2, [1, 99]], "no tensor 99"),
            ([protocol.OP_RUN, 0, 2, "values"], "gives 2 values"),
            ([protocol.OP_RUN, 0, 1, [1, 1]], "handle 1 cannot take a new tensor"),
            ([protocol.OP_PLAN, 1, 1, [{"handle": 1}, TENSOR], None], "through slots"),
            ([protocol.OP_PLAN, 1, 1, [{"slot": "X"}], None], "malformed slot"),
            ([protocol.OP_PLAN, 1, 1, "args", None], "a plan's arguments are a list"),
            ([protocol.OP_PLAN, protocol.PLAN_LIMIT, 1, [TENSOR, TENSOR], None], "not an integer"),
            ([protocol.OP_PLAN, 1, 77, [TENSOR, TENSOR], None], "operator 77 was not defined"),
        ]
        for op, message in cases:
            assert message in error(job.request([op], SYNC)), op
        # the plans of a session hold at most PLAN_LEAVES values together
        third: list[list[Any]] = [[]] * (protocol.PLAN_LEAVES // 3)
        bulky = [[protocol.OP_PLAN, 10 + i, 1, [TENSOR, TENSOR, third], None] for i in range(2)]
        assert job.request(bulky, SYNC).kind == protocol.REPLY
        too_many = [protocol.OP_PLAN, 12, 1, [TENSOR, TENSOR, third], None]
        assert "the session's plans are too large" in error(job.request([too_many], SYNC))
        again = [protocol.OP_PLAN, 10, 1, [TENSOR, TENSOR], None]  # planned again: its values freed
        assert job.request([again, too_many], SYNC).kind == protocol.REPLY
        number = [protocol.OP_PLAN, 3, 1, [TENSOR, TENSOR], {"alpha": NUMBER}]
        assert "not a number" in error(job.request([number, [protocol.OP_RUN, 3, 2, [1, 1, "x"]]], SYNC))
        assert values(job.fetch(1)).tolist() == [0.0, 1.0, 2.0]  # the session lived on
    finally:
        job.close()
