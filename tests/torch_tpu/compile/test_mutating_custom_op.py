"""A ``torch.library.custom_op`` that writes an argument in place, without a JAX lowering, compiled
with backend="tpu" (AOTAutograd's ``auto_functionalized`` and ``auto_functionalized_v2`` nodes)
equals CPU eager: a written graph input, a written slice of a local buffer, and a backward that
updates a table in place (a fused optimizer, the pattern of TorchRec TPU's embedding ops)."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config

import torch_tpu.compile as tc


@torch.library.custom_op("torch_tpu_test::scaled_accumulate", mutates_args=("acc",))
def scaled_accumulate(acc: torch.Tensor, x: torch.Tensor, scale: float) -> torch.Tensor:
    """``acc += scale * x``; returns the row sums of ``x * x``."""
    acc.add_(x * scale)
    return (x * x).sum(dim=1)


@scaled_accumulate.register_fake
def _scaled_accumulate_fake(acc: torch.Tensor, x: torch.Tensor, scale: float) -> torch.Tensor:
    return x.new_empty(x.shape[0])


@torch.library.custom_op("torch_tpu_test::gather_rows", mutates_args=())
def gather_rows(table: torch.Tensor, ids: torch.Tensor, lr: torch.Tensor) -> torch.Tensor:
    return table[ids]


@gather_rows.register_fake
def _gather_rows_fake(table: torch.Tensor, ids: torch.Tensor, lr: torch.Tensor) -> torch.Tensor:
    return table.new_empty(ids.shape[0], table.shape[1])


@torch.library.custom_op("torch_tpu_test::sgd_rows_", mutates_args=("table",))
def sgd_rows_(grad: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, lr: torch.Tensor) -> None:
    """One SGD step on the gathered rows, written into ``table``."""
    table.copy_(table.index_add(0, ids, grad * -lr))


def _setup(ctx, inputs, output) -> None:
    table, ids, lr = inputs
    ctx.save_for_backward(table, ids, lr)


def _backward(ctx, grad: torch.Tensor):
    table, ids, lr = ctx.saved_tensors
    sgd_rows_(grad, table, ids, lr)
    return None, None, None


gather_rows.register_autograd(_backward, setup_context=_setup)


@pytest.fixture(params=[True, False], ids=["v2", "v1"])
def auto_functionalized_version(request):
    with inductor_config.patch(enable_auto_functionalized_v2=request.param):
        yield request.param


def test_written_graph_input_equals_eager(auto_functionalized_version) -> None:
    def f(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return scaled_accumulate(acc, x.sin(), 0.5) * 2

    gen = torch.Generator().manual_seed(0)
    x, acc = torch.randn(5, 3, generator=gen), torch.randn(5, 3, generator=gen)
    acc_before, acc_compiled = acc.clone(), acc.clone()
    out = torch.compile(f, backend="tpu", fullgraph=True, dynamic=False)(acc_compiled, x)
    expected = f(acc, x)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(acc_compiled, acc)
    assert not torch.equal(acc_compiled, acc_before)
    assert tc.compile_stats().graphs == 1


@inductor_config.patch(enable_auto_functionalized_v2=True)  # (v1 writes the slice back with as_strided_scatter)
def test_written_slice_of_a_local_buffer_equals_eager() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        buf = torch.ones(4, 6)
        sums = scaled_accumulate(buf[:, 1:4], x, 3.0)
        return buf * 2, sums

    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(f, backend="tpu", fullgraph=True, dynamic=False)(x)
    for got, want in zip(compiled, f(x)):
        torch.testing.assert_close(got, want)


def test_backward_that_updates_a_table_in_place_equals_eager(auto_functionalized_version) -> None:
    """The fused-optimizer pattern: the forward op's backward writes the table (no gradient), twice."""
    def loss_of(table: torch.Tensor, ids: torch.Tensor, dense: torch.nn.Linear, lr: torch.Tensor) -> torch.Tensor:
        return dense(gather_rows(table, ids, lr)).square().mean()

    gen = torch.Generator().manual_seed(2)
    ids = torch.tensor([0, 3, 3, 7, 1, 0])
    lr = torch.tensor(0.1)
    torch.manual_seed(3)
    dense = torch.nn.Linear(4, 2)
    table = torch.randn(8, 4, generator=gen).requires_grad_()
    table_compiled = table.detach().clone().requires_grad_()
    dense_compiled = torch.nn.Linear(4, 2)
    dense_compiled.load_state_dict(dense.state_dict())
    compiled = torch.compile(loss_of, backend="tpu", fullgraph=True, dynamic=False)
    for _ in range(2):
        loss, expected = compiled(table_compiled, ids, dense_compiled, lr), loss_of(table, ids, dense, lr)
        loss.backward()  # runs the compiled backward graph
        expected.backward()
        torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(table_compiled.detach(), table.detach())
    torch.testing.assert_close(dense_compiled.weight.grad, dense.weight.grad)
    assert [g.kind for g in tc.compiled_graphs()] == ["forward", "backward"]
