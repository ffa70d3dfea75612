"""torch.ops.higher_order.scan in compiled graphs: one lax.scan (an XLA while loop), not an unrolled
body. References: CPU eager torch (values, gradients) and the lowered StableHLO (loop count, the
body's dots appearing once whatever the sequence length)."""

from __future__ import annotations

import pytest
import torch
from torch._higher_order_ops.scan import scan

import torch_tpu  # noqa: F401
from torch_tpu.compile.dynamo import backend


def rnn(h0: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A tanh RNN tower over the sequence dim 0: (final state, every step's output)."""

    def step(h, x):
        h2 = torch.tanh(h @ w + x @ u)
        return h2.clone(), h2 * 2  # carry and output must not alias (scan's rule)

    return scan(step, h0, xs)


def _inputs(steps: int, requires_grad: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(steps)
    h0, xs = torch.randn(3, 8, generator=g), torch.randn(steps, 3, 5, generator=g)
    w, u = torch.randn(8, 8, generator=g) * 0.3, torch.randn(5, 8, generator=g) * 0.3
    return [h0, xs, w.requires_grad_(requires_grad), u.requires_grad_(requires_grad)]


def _count(text: str, op: str) -> int:
    return text.count(f"stablehlo.{op}")


def _graphs(kind: str) -> list[str]:
    return [g.stablehlo() for g in backend.compiled_graphs() if g.kind == kind]


@pytest.mark.parametrize("steps", [4, 40])
def test_forward_equals_eager_and_is_one_loop(steps: int) -> None:
    torch._dynamo.reset()
    backend.reset_compile_stats()
    args = _inputs(steps)
    expected = rnn(*args)
    got = torch.compile(rnn, backend="tpu", fullgraph=True)(*(a.to("tpu") for a in args))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.cpu(), e, rtol=1e-5, atol=1e-5)
    (text,) = _graphs("inference")
    assert _count(text, "while") == 1
    assert _count(text, "dot_general") == 2  # h @ w and x @ u, once: the body is not unrolled


def test_pytree_carry_reverse_and_dim() -> None:
    def fn(init, xs):
        def step(carry, x):
            total, prod = carry["total"], carry["prod"]
            return {"total": total + x["a"], "prod": prod * x["b"]}, (total * x["b"]).sin()

        return scan(step, init, xs, dim=1, reverse=True)

    g = torch.Generator().manual_seed(0)
    init = {"total": torch.zeros(4), "prod": torch.ones(4)}
    xs = {"a": torch.randn(4, 6, generator=g), "b": torch.rand(4, 6, generator=g) + 0.5}
    expected = fn(init, xs)
    to_tpu = lambda tree: torch.utils._pytree.tree_map(lambda t: t.to("tpu"), tree)  # noqa: E731
    got = torch.compile(fn, backend="tpu", fullgraph=True)(to_tpu(init), to_tpu(xs))
    for g_, e in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)):
        torch.testing.assert_close(g_.cpu(), e, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # two graphs with loops: ~9 s on a busy 2-core box
def test_backward_equals_eager_and_is_one_loop() -> None:
    torch._dynamo.reset()
    backend.reset_compile_stats()
    args = _inputs(12, requires_grad=True)
    h, ys = rnn(*args)
    (h.sum() + (ys * ys).mean()).backward()
    tpu_args = [a.detach().to("tpu").requires_grad_(a.requires_grad) for a in args]
    th, tys = torch.compile(rnn, backend="tpu", fullgraph=True)(*tpu_args)
    (th.sum() + (tys * tys).mean()).backward()
    torch.testing.assert_close(th.detach().cpu(), h.detach(), rtol=1e-5, atol=1e-5)
    for ours, ref in zip(tpu_args[2:], args[2:]):
        torch.testing.assert_close(ours.grad.cpu(), ref.grad, rtol=1e-4, atol=1e-5)
    (forward,) = _graphs("forward")
    (backward,) = _graphs("backward")
    assert _count(forward, "while") == 1 and _count(backward, "while") == 1
    assert _count(backward, "dot_general") == 3  # d/dw, d/du and d/dh, once each (no grad for xs)


def test_eager_scan_on_tpu_tensors_runs_torchs_loop() -> None:
    args = _inputs(5)
    expected = rnn(*args)
    got = rnn(*(a.to("tpu") for a in args))  # no compile: torch's dense scan, op by op on the device
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.cpu(), e, rtol=1e-5, atol=1e-5)


class Tower(torch.nn.Module):
    """A sequence tower whose step uses the module's own layers (their weights: scan's additional inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.cell, self.inp = torch.nn.Linear(8, 8), torch.nn.Linear(5, 8)

    def forward(self, h0: torch.Tensor, xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def step(h, x):
            h2 = torch.tanh(self.cell(h) + self.inp(x))
            return h2.clone(), h2

        return scan(step, h0, xs)


@pytest.mark.slow  # ~8 s on a busy 2-core box
def test_module_tower_trains_like_eager() -> None:
    torch.manual_seed(0)
    reference, h0, xs = Tower(), torch.randn(3, 8), torch.randn(6, 3, 5)
    model = Tower()
    model.load_state_dict(reference.state_dict())
    model = model.to("tpu")
    h, ys = reference(h0, xs)
    (h.sum() + ys.sum()).backward()
    th, tys = torch.compile(model, backend="tpu", fullgraph=True)(h0.to("tpu"), xs.to("tpu"))
    (th.sum() + tys.sum()).backward()
    torch.testing.assert_close(tys.detach().cpu(), ys.detach(), rtol=1e-5, atol=1e-5)
    for ours, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad.cpu(), ref.grad, rtol=1e-4, atol=1e-5)
