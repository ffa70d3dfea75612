"""Bucketed batch sizes: exact results, no recompiles inside a bucket, recompiles counted across."""

import copy
import logging

import pytest
import torch

import torch_tpu.compile as tc
from tests.torch_tpu.compile.models import mlp


@pytest.mark.parametrize(
    "policy,sizes",
    [
        (tc.BucketPolicy(limit=64), {0: 1, 1: 1, 2: 2, 3: 4, 5: 8, 64: 64, 65: 128, 130: 192}),
        (tc.BucketPolicy(limit=16, multiple=10, minimum=4), {1: 4, 4: 4, 9: 16, 16: 16, 17: 20, 31: 40}),
    ],
)
def test_bucket_sizes(policy, sizes):
    assert {n: policy.bucket(n) for n in sizes} == sizes


def test_bad_policy_is_rejected():
    with pytest.raises(ValueError, match="power of two.*got 12"):
        tc.BucketPolicy(limit=12)


def test_sizes_within_a_bucket_do_not_recompile(caplog):
    # (an earlier test in the process, e.g. one starting Ray, may have raised the root logger's level)
    caplog.set_level(logging.WARNING, logger="torch_tpu.compile.dynamo.backend")
    torch.manual_seed(0)
    model = mlp([6, 16, 3]).eval()
    run = tc.bucketed(torch.compile(model, backend="tpu", dynamic=False), tc.BucketPolicy(limit=32))
    with torch.no_grad():
        for n in (5, 6, 7, 8):
            x = torch.randn(n, 6)
            out = run(x)
            assert out.shape == (n, 3)
            torch.testing.assert_close(out, model(x))
        assert tc.compile_stats().graphs == 1 and tc.compile_stats().recompiles == 0
        run(torch.randn(9, 6))  # next bucket: 16
    assert tc.compile_stats().graphs == 2 and tc.compile_stats().recompiles == 1
    assert "recompiling the inference graph for new input shapes [(16, 6)" in caplog.text
    assert run.stats.buckets == {8, 16} and run.stats.calls == 5


def test_masked_training_step_is_exact():
    """A mean loss over valid rows gives the unpadded gradients."""
    torch.manual_seed(0)
    eager = mlp([4, 8, 1])
    twin = copy.deepcopy(eager)

    def loss_fn(model, x, y, valid=None):
        per_row = (model(x).squeeze(1) - y).square()
        if valid is None:
            return per_row.mean()
        return (per_row * valid).sum() / valid.sum()

    compiled = tc.bucketed(torch.compile(loss_fn, backend="tpu", dynamic=False), dim=0)
    x, y = torch.randn(5, 4), torch.randn(5)
    compiled(twin, x, y).backward()
    loss_fn(eager, x, y).backward()
    for p, q in zip(eager.parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
