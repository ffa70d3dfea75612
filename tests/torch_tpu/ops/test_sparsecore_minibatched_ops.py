"""The tpu:: SparseCore ops over minibatched buffers (``num_minibatches`` > 1: jax-tpu-embedding's
minibatching layout): the lookup and fused updates equal one pass over the same batch with limits
large enough, bit for bit; on a TPU the custom calls are the kernels' minibatching forms with the
count; bad minibatched buffers raise one line naming the value and its limit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsecore.minibatching import minibatch_entries, op_buffers
from sparsecore.preprocess import preprocess_inputs
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking
from sparsecore.validation import feature_inputs

pytest.importorskip("torch_tpu")
from torch_tpu.ops.sparsecore import touched_rows_ahead  # noqa: E402

BATCH, DIM, SMALL = 64, 8, 16


def _plan(limit: int):
    tables = [TableSpec("t", 500, DIM, "mean", max_ids_per_partition=limit, max_unique_ids_per_partition=limit)]
    features = [FeatureSpec("f", "t", BATCH), FeatureSpec("g", "t", BATCH, weighted=True)]
    return plan_stacking(tables, features, SparseCoreTopology("v5p", 1),
                         stack_to_max_ids_per_partition=lambda *_: limit,
                         stack_to_max_unique_ids_per_partition=lambda *_: limit)


@pytest.fixture(scope="module")
def buffers() -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], int, int]:
    """(minibatched buffers, one pass's buffers with large limits, slots, limit)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 9, size=2 * BATCH)
    ids = rng.integers(0, 500, size=int(lengths.sum()))
    ids[::16] = 11  # a hot id
    kjt = KeyedJaggedTensor(keys=["f", "g"], values=torch.from_numpy(ids), lengths=torch.from_numpy(lengths),
                            weights=torch.from_numpy(rng.random(ids.size).astype(np.float32)))
    small, large = _plan(SMALL), _plan(4096)
    inputs = feature_inputs(kjt, small.features, small.tables)
    stack = small.stacks[0]
    entries = minibatch_entries(stack, inputs, 1, 4)
    split = op_buffers(stack, entries, 1, 4)
    one = preprocess_inputs(inputs, large).stacks[stack.name]
    slots = split.row_pointers.size // (4 * 8)
    assert entries.num_minibatches > 2 and slots == 1 << (entries.num_minibatches - 1).bit_length()

    def tensors(csr):
        return tuple(torch.from_numpy(getattr(csr, f)) for f in ("row_pointers", "embedding_ids", "sample_ids",
                                                                  "gains"))

    return tensors(split), tensors(one), slots, stack.max_ids_per_partition


def _table(rows: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(0).normal(size=(rows, DIM)).astype(np.float32))


@pytest.mark.parametrize("ahead", [pytest.param(False, id="dedup-in-op", marks=pytest.mark.slow),
                                   pytest.param(True, id="touched-ahead")])
def test_minibatched_ops_equal_one_pass_bit_for_bit(buffers, ahead: bool) -> None:
    split, one, slots, limit = buffers
    table = _table(512)
    grad = torch.from_numpy(np.random.default_rng(1).normal(size=(2 * BATCH, DIM)).astype(np.float32))
    extra = {"touched_rows": touched_rows_ahead(*split, 512, 2 * BATCH, num_minibatches=slots)} if ahead else {}
    reference = {"touched_rows": touched_rows_ahead(*one, 512, 2 * BATCH)} if ahead else {}
    limits = (2 * BATCH, limit, limit)
    out = torch.ops.tpu.sparse_dense_matmul(*split, table, *limits, num_minibatches=slots, **extra)
    expected = torch.ops.tpu.sparse_dense_matmul(*one, table, 2 * BATCH, 4096, 4096, **reference)
    assert torch.equal(out, expected)
    lr = torch.tensor(0.3)
    new = torch.ops.tpu.sparse_dense_matmul_grad_with_sgd(*split, table, grad, lr, *limits, num_minibatches=slots,
                                                          **extra)
    assert torch.equal(new, torch.ops.tpu.sparse_dense_matmul_grad_with_sgd(*one, table, grad, lr, 2 * BATCH, 4096,
                                                                            4096, **reference))
    assert not torch.equal(new, table)
    acc = torch.full_like(table, 0.1)
    eps = torch.tensor(1e-8)
    got = torch.ops.tpu.sparse_dense_matmul_grad_with_adagrad(*split, table, acc, grad, lr, eps, *limits,
                                                              num_minibatches=slots, **extra)
    want = torch.ops.tpu.sparse_dense_matmul_grad_with_adagrad(*one, table, acc, grad, lr, eps, 2 * BATCH, 4096,
                                                               4096, **reference)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_tpu_lowering_carries_the_minibatch_count(buffers, monkeypatch) -> None:
    import jax

    from torch_tpu.ops import sparsecore as ops
    from torch_tpu.ops.registry import get_lowering

    split, _, slots, limit = buffers
    monkeypatch.setattr(ops, "_on_tpu_platform", lambda: True)
    arrays = [jax.ShapeDtypeStruct(tuple(t.shape), np.dtype(str(t.dtype).removeprefix("torch."))) for t in split]
    table = jax.ShapeDtypeStruct((512, DIM), np.float32)
    limits = (2 * BATCH, limit, limit)
    lookup = get_lowering(torch.ops.tpu.sparse_dense_matmul.default).fn
    text = jax.jit(lambda *a: lookup(*a, *limits, None, None, slots)).trace(*arrays, table).lower(
        lowering_platforms=("tpu",)).as_text()
    assert "custom_call @SparseDenseMatmulWithMinibatchingOp" in text
    assert f"dense<{slots}> : tensor<i32>" in text  # the count the kernel gets
    sgd = get_lowering(torch.ops.tpu.sparse_dense_matmul_grad_with_sgd.default).fn
    grad = jax.ShapeDtypeStruct((2 * BATCH, DIM), np.float32)
    scalar = jax.ShapeDtypeStruct((), np.float32)
    text = jax.jit(lambda *a: sgd(*a, *limits, "sgd_t", num_minibatches=slots)).trace(
        *arrays, table, grad, scalar).lower(lowering_platforms=("tpu",)).as_text()
    assert "custom_call @SparseDenseMatmulGradOptimizerUpdateWithMinibatchingOp" in text
    assert f"dense<{slots}> : tensor<i32>" in text


def test_bad_minibatched_buffers_raise_one_line(buffers) -> None:
    split, _, slots, limit = buffers
    table = _table(512)
    limits = (2 * BATCH, limit, limit)
    with pytest.raises(ValueError, match=r"num_minibatches must be in \[1, 64\], got 65"):
        torch.ops.tpu.sparse_dense_matmul(*split, table, *limits, num_minibatches=65)
    with pytest.raises(ValueError, match=f"holds .* entries, more than max_ids_per_partition {limit // 2}"):
        torch.ops.tpu.sparse_dense_matmul(*split, table, 2 * BATCH, limit // 2, limit // 2, num_minibatches=slots)
    pointers = split[0].clone()
    pointers[1] = split[1].shape[0] + 1
    with pytest.raises(ValueError, match=r"row_pointers\[1\] = .* is outside"):
        torch.ops.tpu.sparse_dense_matmul(pointers, *split[1:], table, *limits, num_minibatches=slots)
    ids = split[1].clone()
    ids[0] = 10_000
    with pytest.raises(ValueError, match=r"embedding_ids\[0\] = 10000 is outside \[0, 128\)"):
        torch.ops.tpu.sparse_dense_matmul(split[0], ids, *split[2:], table, *limits, num_minibatches=slots)
