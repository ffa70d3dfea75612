"""nn.LSTM / GRU / RNN and their cells on tpu (the fused-cell lowerings of torch_tpu.ops.lowerings.rnn):
outputs, final states and gradients vs CPU torch, with zero CPU fallbacks; and compiled."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import torch_tpu
import torch_tpu.compile  # noqa: F401  (registers backend="tpu")

CASES = {
    "lstm_2layer_batch_first": (lambda: nn.LSTM(4, 5, 2, batch_first=True), (2, 3, 4), None),
    "lstm_bidirectional_no_bias": (lambda: nn.LSTM(4, 5, 1, bias=False, bidirectional=True), (3, 2, 4), None),
    "gru_2layer_bidirectional": (lambda: nn.GRU(4, 5, 2, batch_first=True, bidirectional=True), (2, 3, 4), None),
    "gru_no_bias": (lambda: nn.GRU(4, 5, 1, bias=False), (3, 2, 4), None),
    "rnn_relu": (lambda: nn.RNN(4, 5, 2, nonlinearity="relu"), (3, 2, 4), None),
    "lstm_cell": (lambda: nn.LSTMCell(4, 5), (2, 4), ((2, 5), (2, 5))),
    "gru_cell": (lambda: nn.GRUCell(4, 5), (2, 4), (2, 5)),
}


def _inputs(shape, state):
    x = torch.randn(shape)
    if state is None:
        return (x,)
    if isinstance(state[0], tuple):
        return x, tuple(torch.randn(s) for s in state)
    return x, torch.randn(state)


def _to(args, device):
    return tuple(tuple(t.to(device) for t in a) if isinstance(a, tuple) else a.to(device) for a in args)


def _loss(out):
    """Uses every output (sequence output and final states) so every backward path runs."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return sum((t * torch.linspace(-1, 1, t.numel(), device=t.device).reshape(t.shape)).sum() for t in leaves)


def _check(name, compiled):
    make, shape, state = CASES[name]
    torch.manual_seed(0)
    cpu = make()
    tpu = copy.deepcopy(cpu).to("tpu")
    args = _inputs(shape, state)
    run = torch.compile(tpu, backend="tpu", dynamic=False) if compiled else tpu
    torch_tpu.reset_metrics()
    with torch_tpu.no_fallback():
        actual = run(*_to(args, "tpu"))
        _loss(actual).backward()
    expected = cpu(*args)
    _loss(expected).backward()
    for a, e in zip(torch.utils._pytree.tree_leaves(actual), torch.utils._pytree.tree_leaves(expected)):
        torch.testing.assert_close(a.cpu(), e, rtol=1e-5, atol=1e-5)
    for (pname, p), q in zip(cpu.named_parameters(), tpu.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{pname}: {m}")
    assert torch_tpu.fallback_counts() == {}


@pytest.mark.parametrize("name", CASES)
def test_rnn_eager_matches_cpu_without_fallback(name):
    _check(name, compiled=False)
    if name.startswith(("lstm", "gru")):
        cell = "lstm" if name.startswith("lstm") else "gru"
        assert torch_tpu.lowered_counts().get(f"_thnn_fused_{cell}_cell.default", 0) > 0


@pytest.mark.parametrize("name", ["lstm_2layer_batch_first", "gru_cell"])
def test_rnn_compiled_matches_cpu(name):
    _check(name, compiled=True)


def test_lstm_gradient_through_final_cell_state_only():
    """Autograd gives the fused backward an undefined grad_hy when only c_n is used."""
    torch.manual_seed(0)
    cpu = nn.LSTM(3, 4)
    tpu = copy.deepcopy(cpu).to("tpu")
    x = torch.randn(2, 1, 3)
    with torch_tpu.no_fallback():
        tpu(x.to("tpu"))[1][1].sum().backward()
    cpu(x)[1][1].sum().backward()
    for p, q in zip(cpu.parameters(), tpu.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-5, atol=1e-5)
