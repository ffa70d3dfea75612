"""torch.tpu.ops' TorchTPU ops against CPU torch or hand-computed references, on CPU and tpu."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import torch_tpu  # noqa: F401

ops = torch.tpu.ops
DEVICES = ["cpu", "tpu"]


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _ragged_loop(lhs: torch.Tensor, rhs: torch.Tensor, sizes: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    """The output and the gradients of lhs and rhs, one CPU matmul per group (rows past the groups: 0)."""
    l_ref, r_ref = lhs.clone().requires_grad_(True), rhs.clone().requires_grad_(True)
    rows, start = [], 0
    for g, n in enumerate(sizes.tolist()):
        rows.append(l_ref[start:start + n] @ r_ref[g])
        start += n
    want = torch.cat([*rows, torch.zeros(lhs.shape[0] - start, rhs.shape[2])])
    want.backward(grad)
    return [want.detach(), l_ref.grad, r_ref.grad]


def _ragged_device(lhs: torch.Tensor, rhs: torch.Tensor, sizes: torch.Tensor, grad: torch.Tensor,
                   device: str) -> list[torch.Tensor]:
    left, right = lhs.to(device).requires_grad_(True), rhs.to(device).requires_grad_(True)
    got = ops.ragged_dot(left, right, sizes.to(device))
    got.backward(grad.to(device))
    return [got.detach().cpu(), left.grad.cpu(), right.grad.cpu()]


@pytest.mark.parametrize("device", DEVICES)
def test_ragged_dot_equals_a_loop_of_matmuls_with_its_gradients(device: str) -> None:
    lhs, rhs, sizes = _rand(7, 4), _rand(3, 4, 5, seed=1), torch.tensor([2, 0, 4])  # row 6: no group
    grad = _rand(7, 5, seed=2)
    want = _ragged_loop(lhs, rhs, sizes, grad)
    for got, expected in zip(_ragged_device(lhs, rhs, sizes, grad, device), want):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    weight_grad = ops.ragged_dot_weight_grad(lhs.to(device), grad.to(device), sizes.to(device))
    torch.testing.assert_close(weight_grad.cpu(), want[2], rtol=1e-5, atol=1e-5)
    out = torch.empty(7, 5, device=device)
    assert ops.ragged_dot(lhs.to(device), rhs.to(device), sizes.to(device), out=out) is out
    torch.testing.assert_close(out.cpu(), want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_ragged_dot_keeps_a_nan_or_inf_within_its_group(device: str) -> None:
    # 0 * inf and 0 * NaN are NaN: masking only the products spread them to every group's gradients
    lhs, rhs, sizes = _rand(7, 4), _rand(3, 4, 5, seed=1), torch.tensor([2, 1, 3])  # row 6: no group
    grad = _rand(7, 5, seed=2)
    lhs[0, 1] = math.inf  # group 0
    rhs[2, 3, 0] = math.nan  # group 2
    grad[6, 2] = math.nan  # no group
    want = _ragged_loop(lhs, rhs, sizes, grad)
    assert want[1][2:3].isfinite().all() and want[2][1].isfinite().all()  # group 1 is clean
    for got, expected in zip(_ragged_device(lhs, rhs, sizes, grad, device), want):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, equal_nan=True)
    weight_grad = ops.ragged_dot_weight_grad(lhs.to(device), grad.to(device), sizes.to(device))
    torch.testing.assert_close(weight_grad.cpu(), want[2], rtol=1e-5, atol=1e-5, equal_nan=True)


def test_ragged_dot_names_a_bad_shape() -> None:
    with pytest.raises(ValueError, match=r"rhs must be \(g, k, n\) with g = len\(group_sizes\) = 2"):
        ops.ragged_dot(_rand(4, 3), _rand(3, 3, 2), torch.tensor([2, 2]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_max_pool_and_its_backward_equal_torch(device: str, n: int) -> None:
    x = _rand(2, 3, *([6] * n))
    args = ([3] * n, [2] * n, [1] * n, [1] * n, True)
    pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[n - 1]
    ref = x.clone().requires_grad_(True)
    want = pool(ref, *args)
    grad = _rand(*want.shape, seed=3)
    want.backward(grad)
    got = getattr(ops, f"max_pool{n}d")(x.to(device), *args)
    torch.testing.assert_close(got.cpu(), want.detach())
    back = getattr(ops, f"max_pool{n}d_backward")(grad.to(device), x.to(device), *args)
    torch.testing.assert_close(back.cpu(), ref.grad)
    with pytest.raises(ValueError, match="kernel_size needs one value per spatial dim"):
        getattr(ops, f"max_pool{n}d")(x, [3] * (n + 1), *args[1:])


@pytest.mark.parametrize("device", DEVICES)
def test_optimization_barrier_passes_values_through(device: str) -> None:
    a, b = _rand(3).to(device), _rand(2, 2, seed=1).to(device)
    out = ops.optimization_barrier([a, b])
    assert isinstance(out, list) and len(out) == 2
    torch.testing.assert_close(out[0].cpu(), a.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(out[1].cpu(), b.cpu(), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_gather_scatter_and_iota(device: str) -> None:
    operand, row_pointers = _rand(5, 3), torch.tensor([0, 2, 3], dtype=torch.int32)
    indices = torch.tensor([4, 0, 1, 1, 3, 2], dtype=torch.int32)  # 3 rows x 2 slots
    got = ops.sparse_gather(row_pointers.to(device), indices.to(device), operand.to(device), 2)
    torch.testing.assert_close(got.cpu(), operand[indices.long()], rtol=0, atol=0)
    grad = _rand(6, 3, seed=1)
    back = ops.sparse_gather_backward(grad.to(device), indices.to(device), torch.zeros(5, 3, device=device))
    want = torch.zeros(5, 3).index_add(0, indices.long(), grad)
    torch.testing.assert_close(back.cpu(), want)
    iota = ops.sparse_iota(torch.tensor([0, 2, 3, 6], dtype=torch.int32).to(device), 8, 3)
    assert iota.cpu().tolist() == [0, 1, 0, 0, 1, 2, 0, 0]  # rows [0,2) [2,3) [3,6), nothing past 6
    with pytest.raises(ValueError, match=r"indices must be 1-D of len\(row_pointers\) \* max_non_zeroes_per_row"):
        ops.sparse_gather(row_pointers, indices, operand, 3)


def test_sparse_map_row_names_the_tpu_requirement() -> None:
    with pytest.raises(NotImplementedError, match="needs a TPU with SparseCores"):
        ops.sparse_map_row([torch.zeros(2)], [1], [], "module {}", [torch.zeros(2)], 1, 0, 0, 0.5, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_stack_inverts_the_activation_unstack(device: str) -> None:
    batch, dims, width = 4, [3, 8, 5], 8
    stacked = _rand(batch * len(dims), width)
    pieces = ops.sparse_dense_matmul_activation_unstack(stacked.to(device), [batch] * 3, dims)
    back = ops.sparse_dense_matmul_gradient_stack(pieces, batch * 3, width)
    mask = torch.zeros(batch * 3, width)  # the stack's columns past each feature's dim come back 0
    for row in range(batch * 3):
        feature = (row % (len(dims) * batch // 2)) // (batch // 2)
        mask[row, :dims[feature]] = 1
    torch.testing.assert_close(back.cpu(), stacked * mask, rtol=0, atol=0)


def _attention(q, k, v, mask, scale):
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf")) if mask is not None else scores
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("device", DEVICES)
def test_splash_sdpa_is_exact_attention(device: str) -> None:
    q, k, v = _rand(1, 4, 6, 8), _rand(1, 2, 6, 8, seed=1), _rand(1, 2, 6, 8, seed=2)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    cases = (({}, j <= i), ({"is_causal": False}, None), ({"local_window_size": 2}, (j <= i) & (j >= i - 2)),
             ({"local_window_size": 0}, j == i))
    for kwargs, mask in cases:
        got = ops.splash_sdpa(q.to(device), k.to(device), v.to(device), enable_gqa=True, **kwargs)
        torch.testing.assert_close(got.cpu(), _attention(q, kk, vv, mask, 1 / math.sqrt(8)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"enable_gqa \(False\) does not match inputs"):
        ops.splash_sdpa(q, k, v)


def test_splash_sdpa_refuses_a_negative_window() -> None:
    # -3 was taken: every query masked off, rows of NaN
    q = _rand(1, 2, 6, 8).to("tpu")
    with pytest.raises(ValueError, match=r"^splash_sdpa: local_window_size must be >= 0 \(or None\), got -3$"):
        ops.splash_sdpa(q, q, q, local_window_size=-3)


def test_per_table_stats_are_the_busiest_partition() -> None:
    # 4 samples over 2 SparseCores (2 each) and 4 partitions (2 devices x 2): id % 4
    ids = torch.tensor([0, 4, 4, 1, 8, 5, 2, 3], dtype=torch.int32)
    offsets = torch.tensor([0, 3, 5, 6, 8], dtype=torch.int32)
    # SparseCore 0 (samples 0, 1): ids 0, 4, 4, 1, 8 -> partition 0 holds 0, 4, 4, 8 (4 ids, 3 unique)
    assert torch.ops.tpu.compute_sparse_dense_matmul_stats(ids, offsets, 2, 2) == (4, 3)


def test_per_table_preprocessing_equals_the_stacked_backend() -> None:
    from sparsecore.metadata_backend import SparseCorePreprocessorBackend

    ids = torch.tensor([0, 4, 4, 1, 8, 5, 2, 3], dtype=torch.int32)
    offsets = torch.tensor([0, 3, 5, 6, 8], dtype=torch.int32)
    got = torch.ops.tpu.preprocess_sparse_dense_matmul_input(ids, offsets, 16, 16, 0, 4, "sum", 1, 1, 2, False, "t")
    table = {"name": "t", "max_ids_per_partition": 16, "max_unique_ids_per_partition": 16,
             "features": [{"name": "t", "row_offset": 0, "col_offset": 0, "col_shift": 0, "batch_size": 4,
                           "combiner": "sum"}]}
    want = SparseCorePreprocessorBackend([table], 4, 1, 1, 2).preprocess({"t": [ids]}, {"t": [offsets]})["t"]
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, equal_nan=True)  # padding: NaN gains
