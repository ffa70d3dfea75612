"""``fused_update_`` (torch_tpu.ops.sparsecore_inplace): the fused SparseCore updates stored into
their tpu table and slots with those buffers donated; the functional op on CPU is the reference."""

from __future__ import annotations

import pytest
import torch

from tests.torch_tpu.ops.sparsecore_case import Case
from torch_tpu.ops.sparsecore_inplace import fused_update_
from torch_tpu.runtime.tensor import to_jax

# optimizer -> (slots as full values, hyperparameters): every fused op
CALLS = {
    "sgd": ([], [torch.tensor(0.1)]),
    "adagrad": ([0.1], [torch.tensor(0.1), torch.tensor(1e-8)]),
    "rowwise_adagrad": (["row"], [torch.tensor(0.1), torch.tensor(1e-8)]),
    "adam": ([0.0, 0.0], [torch.tensor(0.01), 0.9, 0.999, 1e-8]),
    "ftrl": ([0.1, 0.0], [torch.tensor(0.1), -0.5, 0.01, 0.001, 0.0]),
}


def _slots(case: Case, optimizer: str) -> list[torch.Tensor]:
    return [torch.full((case.table.shape[0],), 0.1) if value == "row" else torch.full_like(case.table, value)
            for value in CALLS[optimizer][0]]


@pytest.fixture(scope="module")
def case() -> Case:
    return Case()


@pytest.mark.parametrize("optimizer", sorted(CALLS))
def test_in_place_equals_the_functional_op_twice_and_donates_the_buffers(case: Case, optimizer: str) -> None:
    name = f"sparse_dense_matmul_grad_with_{optimizer}"
    hypers = CALLS[optimizer][1]
    expected = [case.table, *_slots(case, optimizer)]
    state = [t.to("tpu") for t in expected]
    for _ in range(2):  # the second step reads the first's results
        out = getattr(torch.ops.tpu, name)(*case.csr, *expected, case.grad, *hypers, *case.limits)
        expected = list(out) if isinstance(out, tuple) else [out]
        where = [to_jax(t).unsafe_buffer_pointer() for t in state]
        fused_update_(name, *case.on("tpu"), *state, case.grad.to("tpu"),
                      *[h.to("tpu") if isinstance(h, torch.Tensor) else h for h in hypers], *case.limits)
        assert [to_jax(t).unsafe_buffer_pointer() for t in state] == where  # donated: updated where it was
        for ours, reference in zip(state, expected):
            torch.testing.assert_close(ours.cpu(), reference, rtol=1e-5, atol=1e-6)


def test_a_clone_sharing_the_buffer_keeps_its_value(case: Case) -> None:
    table, acc = case.table.to("tpu"), torch.full_like(case.table, 0.1).to("tpu")
    snapshot, acc_snapshot = table.clone(), acc.clone()  # (share the JAX arrays)
    fused_update_("sparse_dense_matmul_grad_with_adagrad", *case.on("tpu"), table, acc, case.grad.to("tpu"),
                  torch.tensor(0.1).to("tpu"), torch.tensor(1e-8).to("tpu"), *case.limits)
    assert torch.equal(snapshot.cpu(), case.table) and torch.equal(acc_snapshot.cpu(), torch.full_like(case.table, 0.1))
    assert not torch.equal(table.cpu(), case.table)
    assert to_jax(snapshot).unsafe_buffer_pointer() != to_jax(table).unsafe_buffer_pointer()


def test_refuses_a_host_table_and_a_non_fused_op(case: Case) -> None:
    with pytest.raises(TypeError, match="embedding_table is on cpu"):
        fused_update_("sparse_dense_matmul_grad_with_sgd", *case.csr, case.table, case.grad, torch.tensor(0.1),
                      *case.limits)
    with pytest.raises(ValueError, match="takes a fused op"):
        fused_update_("sparse_dense_matmul", *case.csr, case.table.to("tpu"), *case.limits)


def test_checks_the_inputs_as_an_eager_call_does(case: Case) -> None:
    bad_ids = case.csr[1].clone()
    bad_ids[0] = 10_000
    with pytest.raises(ValueError, match="embedding_ids"):
        fused_update_("sparse_dense_matmul_grad_with_sgd", case.csr[0].to("tpu"), bad_ids.to("tpu"),
                      *[t.to("tpu") for t in case.csr[2:]], case.table.to("tpu"), case.grad.to("tpu"),
                      torch.tensor(0.1).to("tpu"), *case.limits)
