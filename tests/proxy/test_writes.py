"""What the server counts as written by an operator (writes.py): a pre-copy trusts version
counters to move with every write, and dedup must copy a shared storage before one."""

from __future__ import annotations

import pytest
import torch

from singularity.proxy.server.host_kernels import install
from singularity.proxy.server.writes import note_writes, written_tensors


@pytest.mark.parametrize(
    "operator",
    [torch.ops.aten.native_batch_norm.default, torch.ops.aten._batch_norm_impl_index.default],
    ids=["native_batch_norm", "_batch_norm_impl_index"],
)
def test_a_batch_norm_in_training_writes_its_running_statistics(operator: torch._ops.OpOverload) -> None:
    """BatchNorm's schema does not mark its running mean and variance written, yet in training it
    updates them in place: they count as written then (their versions move), and not in eval."""
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    weight, bias = torch.ones(3), torch.zeros(3)
    extra = (True,) if operator is torch.ops.aten._batch_norm_impl_index.default else ()
    for training in (True, False):
        mean, var = torch.zeros(3), torch.ones(3)
        args = (x, weight, bias, mean, var, training, 0.1, 1e-5, *extra)
        before = (mean._version, var._version, mean.clone(), var.clone())
        operator(*args)
        note_writes(operator, args, {})
        changed = not (torch.equal(mean, before[2]) and torch.equal(var, before[3]))
        assert changed == training, "the kernel updates the statistics in training only"
        assert {id(t) for t in written_tensors(operator, args, {})} == (
            {id(mean), id(var)} if training else set()
        )
        assert (mean._version > before[0] and var._version > before[1]) == training


def test_sync_batch_norm_s_gathering_of_statistics_writes_the_running_statistics() -> None:
    """SyncBatchNorm's gathering of every rank's statistics updates the running mean and variance
    in place without its schema saying so: they count as written (host_kernels.py runs it on a
    virtual device)."""
    install()
    operator = torch.ops.aten.batch_norm_gather_stats_with_counts.default
    x = torch.randn(4, 3)
    mean, invstd = torch.randn(2, 3), torch.rand(2, 3) + 0.5
    running_mean, running_var = torch.zeros(3), torch.ones(3)
    args = (x, mean, invstd, running_mean, running_var, 0.1, 1e-5, torch.tensor([4.0, 4.0]))
    versions = (running_mean._version, running_var._version)
    operator(*args)
    assert not torch.equal(running_mean, torch.zeros(3)) and not torch.equal(running_var, torch.ones(3))
    assert {id(t) for t in written_tensors(operator, args, {})} == {id(running_mean), id(running_var)}
    note_writes(operator, args, {})
    assert running_mean._version > versions[0] and running_var._version > versions[1]
