"""Sparse gradients on tpu: ``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag(sparse=True)`` trained
with SGD, SparseAdam and Adagrad vs CPU torch from the same init (no CPU fallback), and the sparse
COO tensor ops they use (coalesce, dense += sparse, sparse + sparse, sparse_mask) vs CPU."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import torch_tpu

TOL = dict(rtol=1e-5, atol=1e-6)
# batches with repeated rows (uncoalesced gradients) and the padding row 0
BATCHES = [torch.tensor([1, 2, 1, 5, 0, 7]), torch.tensor([3, 3, 3, 9, 1, 0]), torch.tensor([5, 6, 2, 1, 8, 5])]
OFFSETS = torch.tensor([0, 2, 2, 4])  # bag 1 is empty
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.5),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9, dampening=0.1, nesterov=False),
    "sparse_adam": lambda p: torch.optim.SparseAdam(p, lr=0.1),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.5, lr_decay=0.01, initial_accumulator_value=0.1),
}
MODULES = {
    "embedding": lambda: torch.nn.Embedding(10, 4, sparse=True),
    "embedding_padding_idx": lambda: torch.nn.Embedding(10, 4, padding_idx=0, sparse=True),
    "bag_sum": lambda: torch.nn.EmbeddingBag(10, 4, mode="sum", sparse=True),
    "bag_mean_padding_idx": lambda: torch.nn.EmbeddingBag(10, 4, mode="mean", padding_idx=0, sparse=True),
    "bag_sum_per_sample_weights": lambda: torch.nn.EmbeddingBag(10, 4, mode="sum", sparse=True),
    "bag_sum_last_offset": lambda: torch.nn.EmbeddingBag(10, 4, mode="sum", include_last_offset=True, sparse=True),
}


@pytest.fixture(autouse=True)
def _no_sparse_invariant_warning():
    with warnings.catch_warnings():  # Adagrad builds its updates with torch.sparse_coo_tensor
        warnings.filterwarnings("ignore", "Sparse invariant checks")
        yield


def _forward(name, module, indices, device):
    indices = indices.to(device)
    if name.startswith("embedding"):
        return module(indices)
    offsets = OFFSETS.to(device)
    if name == "bag_sum_last_offset":
        offsets = torch.cat([offsets, torch.tensor([indices.numel()], device=device)])
    weights = torch.linspace(0.5, 2, indices.numel()).to(device) if name.endswith("per_sample_weights") else None
    return module(indices, offsets, per_sample_weights=weights)


def _train(name, module, optimizer, device):
    """Three steps; per step the loss, the gradient (dense) and the parameter, on CPU; then the
    optimizer's state."""
    history = []
    for batch in BATCHES:
        optimizer.zero_grad()
        out = _forward(name, module, batch, device)
        loss = (out * torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape).sin().to(device)).sum()
        loss.backward()
        grad = module.weight.grad
        assert grad.is_sparse and grad.device.type == device
        optimizer.step()
        history.append((loss.detach().cpu(), grad.to_dense().cpu(), module.weight.detach().to("cpu", copy=True)))
    state = optimizer.state[module.weight]
    return history, {k: v.to("cpu", copy=True) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


# Default run: every optimizer and every module at least once; the full product is slow.
_DEFAULT = {("embedding", "sgd"), ("embedding_padding_idx", "sparse_adam"), ("bag_sum", "adagrad"),
            ("bag_mean_padding_idx", "adagrad"), ("bag_sum_per_sample_weights", "sgd_momentum"),
            ("bag_sum_last_offset", "sgd")}


@pytest.mark.parametrize("name,opt", [
    pytest.param(name, opt, marks=() if (name, opt) in _DEFAULT else pytest.mark.slow)
    for name in MODULES for opt in OPTIMIZERS])
def test_sparse_embedding_trains_like_cpu(name, opt):
    torch.manual_seed(0)
    cpu = MODULES[name]()
    tpu = copy.deepcopy(cpu).to("tpu")
    expected, expected_state = _train(name, cpu, OPTIMIZERS[opt](cpu.parameters()), "cpu")
    torch_tpu.reset_metrics()
    with torch_tpu.no_fallback():
        actual, actual_state = _train(name, tpu, OPTIMIZERS[opt](tpu.parameters()), "tpu")
    assert torch_tpu.fallback_counts() == {}
    for step, (a, e) in enumerate(zip(actual, expected)):
        for what, x, y in zip(("loss", "gradient", "weight"), a, e):
            torch.testing.assert_close(x, y, msg=lambda m: f"step {step} {what}: {m}", **TOL)
    assert actual_state.keys() == expected_state.keys()
    for key, value in expected_state.items():
        if isinstance(value, torch.Tensor) and value.is_sparse:  # SGD's momentum buffer
            # an uncoalesced sum's entries may differ from CPU's merge (CUDA concatenates too): same values
            assert actual_state[key].is_coalesced() == value.is_coalesced()
            actual_state[key], value = actual_state[key].to_dense(), value.to_dense()
        torch.testing.assert_close(actual_state[key], value, msg=lambda m: f"state {key}: {m}", **TOL)


def _coo(indices, values, size):
    return torch.sparse_coo_tensor(torch.tensor(indices), values, size)


def _check_sparse(actual, expected):
    assert actual.is_sparse and actual.device.type == "tpu"
    assert actual.is_coalesced() == expected.is_coalesced()
    if expected.is_coalesced():
        torch.testing.assert_close(actual._indices().cpu(), expected._indices(), rtol=0, atol=0)
        torch.testing.assert_close(actual._values().cpu(), expected._values(), **TOL)
    torch.testing.assert_close(actual.to_dense().cpu(), expected.to_dense(), **TOL)


def test_coalesce_hybrid_and_empty():
    torch.manual_seed(0)
    for s in (_coo([[3, 0, 3, 1, 0], [1, 2, 1, 0, 2]], torch.randn(5, 2), (4, 3, 2)),  # 2 sparse dims, 1 dense
              _coo([[2]], torch.randn(1, 3), (4, 3)),
              torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.int64), torch.zeros(0, 3), (4, 3))):
        t = s.to("tpu")
        assert t.is_coalesced() == s.is_coalesced()
        _check_sparse(t.coalesce(), s.coalesce())


def test_sparse_arithmetic_like_cpu():
    torch.manual_seed(0)
    a = _coo([[3, 1, 3]], torch.randn(3, 2), (5, 2))
    b = _coo([[0, 1]], torch.randn(2, 2), (5, 2))
    dense = torch.randn(5, 2)
    ta, tb, tdense = a.to("tpu"), b.to("tpu"), dense.to("tpu")
    torch.testing.assert_close(torch.add(tdense, ta, alpha=0.5).cpu(), torch.add(dense, a, alpha=0.5), **TOL)
    torch.testing.assert_close(tdense.clone().add_(ta, alpha=-2).cpu(), dense.clone().add_(a, alpha=-2), **TOL)
    for x, y, tx, ty in ((a, b, ta, tb), (a.coalesce(), b.coalesce(), ta.coalesce(), tb.coalesce())):
        _check_sparse(tx + ty, x + y)
        _check_sparse(tx.clone().add_(ty, alpha=3), x.clone().add_(y, alpha=3))
        _check_sparse(tx * 2.5, x * 2.5)
        _check_sparse(tx.clone().mul_(torch.tensor(-1.5)), x.clone().mul_(torch.tensor(-1.5)))
        _check_sparse(tdense.sparse_mask(tx), dense.sparse_mask(x))
    with pytest.raises(RuntimeError, match="add\\(sparse, dense\\) is not supported"):
        ta + tdense
    with pytest.raises(RuntimeError, match="same size"):
        tdense.add_(_coo([[0]], torch.ones(1, 3), (5, 3)).to("tpu"))


def test_sparse_round_trip_and_printing():
    s = _coo([[1, 2, 1]], torch.tensor([1.0, 2.0, 3.0]), (4,))
    t = s.to("tpu")
    assert t._indices().device.type == "tpu" and t._values().device.type == "tpu"
    back = t.cpu()
    assert back.is_sparse and back.device.type == "cpu"
    torch.testing.assert_close(back.to_dense(), s.to_dense())
    assert "device='tpu:0'" in repr(t) and "nnz=3" in repr(t)
    assert f"{torch.tensor(1.25, device='tpu'):.1f}" == f"{torch.tensor(1.25):.1f}"
    z = torch.zeros(3, 2, layout=torch.sparse_coo, device="tpu")
    assert z.is_sparse and z._nnz() == 0 and z._values().device.type == "tpu"


def test_sparse_gradients_accumulate_like_cpu():
    """Two lookups in one forward (sparse + sparse in autograd), a second backward without zero_grad
    (accumulated into .grad) and zero_grad(set_to_none=False) (sparse zero_)."""
    torch.manual_seed(0)
    cpu = torch.nn.Embedding(6, 3, sparse=True)
    tpu = copy.deepcopy(cpu).to("tpu")
    grads = []
    for module, device in ((cpu, "cpu"), (tpu, "tpu")):
        lookup = module(torch.tensor([1, 1, 2], device=device)), module(torch.tensor([2, 4], device=device))
        twice = (lookup[0] * 2).sum() + lookup[1].sum()
        twice.backward()
        module(torch.tensor([5, 1], device=device)).pow(2).sum().backward()
        accumulated = module.weight.grad.coalesce()
        torch.optim.SGD(module.parameters(), lr=0.1).zero_grad(set_to_none=False)
        grads.append((accumulated, module.weight.grad))
    (expected, expected_zero), (actual, actual_zero) = grads
    _check_sparse(actual, expected)
    assert actual_zero.is_sparse and actual_zero._nnz() == 0 == expected_zero._nnz()


def test_other_sparse_ops_fall_back_to_cpu():
    """Sparse ops without a device kernel run on CPU copies: counted, refused under no_fallback."""
    s = _coo([[0, 2, 0], [1, 1, 2]], torch.tensor([1.0, 2.0, 3.0]), (3, 3))
    m = torch.randn(3, 4)
    torch_tpu.reset_metrics()
    actual = torch.sparse.mm(s.to("tpu"), m.to("tpu"))
    assert actual.device.type == "tpu"
    torch.testing.assert_close(actual.cpu(), torch.sparse.mm(s, m), **TOL)
    assert torch_tpu.fallback_counts()
    with torch_tpu.no_fallback(), pytest.raises(torch_tpu.TpuFallbackError):
        torch.sparse.mm(s.to("tpu"), m.to("tpu"))
