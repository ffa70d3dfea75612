"""Dynamic dims under torch.compile(backend="tpu"): sizes up to a bound share one padded program
with exact results (torch_tpu.compile.dynamo.bounded); graphs it cannot bound run one program per size."""

import copy
import logging

import pytest
import torch
from torch import nn

from tests.torch_tpu.compile.models import DLRMDense, mlp
from torch_tpu.compile.dynamo import backend, bounded, specialize


def _fwd_bwd(model, x):
    out = model(x)
    out.square().sum().backward()
    return out


def _check_like_cpu(cpu_model, tpu_model, x, compiled):
    expected = _fwd_bwd(cpu_model, x)
    actual = _fwd_bwd(compiled, x.to("tpu"))
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(cpu_model.named_parameters(), tpu_model.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        p.grad, q.grad = None, None


def test_two_different_sequentials_in_one_process():
    """The second compile of ``nn.Sequential.forward`` gets automatic dynamic dims from Dynamo."""
    torch.manual_seed(0)
    cpu_models = [mlp([8, 16, 1]), mlp([5, 7, 3])]
    tpu_models = [copy.deepcopy(m).to("tpu") for m in cpu_models]
    compiled = [torch.compile(m, backend="tpu") for m in tpu_models]
    for batch in (4, 6, 3):
        for cpu, tpu, fn in zip(cpu_models, tpu_models, compiled):
            x = torch.randn(batch, cpu[0].in_features)
            _check_like_cpu(cpu, tpu, x, fn)


def _train_like_cpu(cpu_model, sizes, make_inputs, dynamic=True, mark=()):
    """Forward + backward of ``cpu_model`` and of its tpu copy compiled, for each size: loss and
    parameter gradients equal."""
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    compiled = torch.compile(tpu_model, backend="tpu", dynamic=dynamic)
    for size in sizes:
        inputs = make_inputs(size)
        expected = cpu_model(*inputs)
        expected.backward()
        on_tpu = [t.to("tpu") for t in inputs]
        for i, dim in mark:
            torch._dynamo.mark_dynamic(on_tpu[i], dim)
        actual = compiled(*on_tpu)
        actual.backward()
        torch.testing.assert_close(actual.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(cpu_model.named_parameters(), tpu_model.parameters()):
            torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
            p.grad, q.grad = None, None


class _Classifier(nn.Module):
    """Embedding, layer norm over features, mean over a dynamic sequence, cross entropy."""

    def __init__(self):
        super().__init__()
        self.emb, self.norm, self.head = nn.Embedding(20, 6), nn.LayerNorm(6), nn.Linear(6, 5)

    def forward(self, ids, labels):
        return nn.functional.cross_entropy(self.head(self.norm(self.emb(ids)).mean(1)), labels)


class _Attention(nn.Module):
    """Softmax attention over a dynamic sequence length (and batch): dims flattened for the
    projections, a softmax and a contraction over the padded length."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, target):
        weights = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) / 8 ** 0.5, dim=-1)
        return ((weights @ x).sum(1) - target).square().mean()


class _Extremes(nn.Module):
    """Reductions that zero padding alone would get wrong: a max of negatives, a sum of exp, a mean."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        y = self.lin(x) - 10
        return y.amax(0).sum() + y.exp().sum() + y.mean() + x.shape[0] * y.logsumexp(0).sum()


BATCHES = (5, 7, 9, 6, 10, 8)  # the first size bounds at 10: one program each for forward and backward


@pytest.mark.parametrize("case", ["mlp_bce", "dlrm_dense", "classifier", "attention", "extremes"])
def test_dynamic_sizes_share_one_bounded_program_and_equal_cpu(case):
    torch.manual_seed(3)
    bounded.reset_bounded_stats()
    if case == "mlp_bce":
        model = _Loss(mlp([4, 8, 1]), lambda out, y: nn.functional.binary_cross_entropy_with_logits(out.squeeze(1), y))
        _train_like_cpu(model, BATCHES, lambda b: (torch.randn(b, 4), torch.rand(b)))
    elif case == "dlrm_dense":  # the batch dim marked dynamic, as an eval/infer loop over a last short batch
        model = _Loss(DLRMDense(), nn.functional.binary_cross_entropy_with_logits)
        _train_like_cpu(model, BATCHES, lambda b: (torch.randn(b, 13), torch.randn(b, 4, 16), torch.rand(b)),
                        dynamic=None, mark=[(0, 0), (1, 0), (2, 0)])
    elif case == "classifier":
        _train_like_cpu(_Classifier(), BATCHES, lambda b: (torch.randint(0, 20, (b, 3)), torch.randint(0, 5, (b,))))
    elif case == "attention":
        _train_like_cpu(_Attention(), BATCHES, lambda n: (torch.randn(2, n, 8), torch.randn(2, 8)))
    else:
        _train_like_cpu(_Extremes(), BATCHES, lambda b: (torch.randn(b, 3),))
    stats = bounded.bounded_stats()
    assert (stats.bounded_programs, stats.exact_programs) == (2, 0), stats


class _Loss(nn.Module):
    def __init__(self, model, loss):
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, *inputs):
        return self.loss(self.model(*inputs[:-1]), inputs[-1])


def test_a_size_past_the_bound_doubles_it_and_the_shape_env_bound_is_used():
    torch.manual_seed(4)
    bounded.reset_bounded_stats()
    model = _Loss(mlp([4, 8, 1]), lambda out, y: (out.squeeze(1) - y).square().mean())
    _train_like_cpu(model, (3, 5, 6, 13, 2), lambda b: (torch.randn(b, 4), torch.randn(b)))
    assert bounded.bounded_stats().bounded_programs == 4  # bounds 6, then 13 (past 12): forward and backward

    torch._dynamo.reset()
    bounded.reset_bounded_stats()
    linear = nn.Linear(4, 2).to("tpu")
    fn = torch.compile(linear, backend="tpu")
    with torch.no_grad():
        for b in (3, 40, 64, 17):
            x = torch.randn(b, 4)
            xt = x.to("tpu")
            torch._dynamo.mark_dynamic(xt, 0, min=2, max=64)
            torch.testing.assert_close(fn(xt).cpu(), nn.functional.linear(x, linear.weight.cpu(), linear.bias.cpu()),
                                       rtol=1e-5, atol=1e-6)
    assert bounded.bounded_stats().bounded_programs == 1  # bound 64 from mark_dynamic's max


def test_outputs_viewing_an_intermediate_are_cpus_views():
    """AOTAutograd rebuilds an output that views an intermediate from that intermediate (another
    output of the program) by the view's own size, stride and offset when the view has symbolic
    sizes: outputs come back as CPU's views, over the intermediate at its true (unpadded) size."""
    torch._dynamo.reset()
    bounded.reset_bounded_stats()

    def heads(x):  # x: [rows, n]; the outputs are views of the intermediate x * 2, one with symbolic sizes
        doubled = x * 2
        return doubled[:, :2], doubled.t()[1:], doubled.view(1, 3, x.shape[1])[:, 1:]

    fn = torch.compile(heads, backend="tpu")
    for n in (5, 7, 4):
        x = torch.arange(3.0 * n).reshape(3, n).requires_grad_()  # outputs of an autograd graph
        xt = x.detach().to("tpu").requires_grad_()
        torch._dynamo.mark_dynamic(xt, 1)
        for got, want in zip(fn(xt), heads(x)):
            assert (got.shape, got.stride(), got.storage_offset()) == (want.shape, want.stride(), want.storage_offset())
            torch.testing.assert_close(got.detach().cpu(), want.detach(), rtol=0, atol=0)
    assert bounded.bounded_stats().bounded_programs >= 1


def test_a_graph_the_rewrite_cannot_bound_runs_one_exact_program_per_size(caplog):
    """Training-mode batch norm reduces over the batch with its own count: no padded program."""
    torch.manual_seed(5)
    bounded.reset_bounded_stats()
    model = _Loss(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), lambda out, y: (out.sum(1) - y).square().mean())
    with caplog.at_level(logging.INFO, logger=bounded.__name__):
        _train_like_cpu(model, (5, 7, 5), lambda b: (torch.randn(b, 4), torch.randn(b)))
    assert bounded.bounded_stats().exact_programs == 4  # sizes 5 and 7, forward and backward
    assert any("batch_norm" in r.getMessage() for r in caplog.records), caplog.records


def test_a_failing_symbolic_trace_falls_back_to_one_trace_per_shape(caplog, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("symbolic trace refused for the test")

    monkeypatch.setattr(backend, "BoundedGraph", refuse)
    monkeypatch.setattr(specialize, "WARN_AFTER", 2)
    specialize.reset_specializations()
    torch.manual_seed(1)
    cpu = nn.Linear(8, 3)
    tpu = copy.deepcopy(cpu).to("tpu")
    fn = torch.compile(tpu, backend="tpu")
    with caplog.at_level(logging.WARNING, logger=specialize.__name__):
        for batch in (3, 5, 3, 7):
            x = torch.randn(batch, 8)
            xt = x.to("tpu")
            torch._dynamo.mark_dynamic(xt, 0)
            _check_like_cpu(cpu, tpu, x, fn)
    assert specialize.specializations() == 3  # batch 3 came back: its program is reused
    warnings = [r.getMessage() for r in caplog.records if r.name == specialize.__name__]
    assert len(warnings) == 1 and "input" in warnings[0] and "dim 0" in warnings[0], warnings


def test_embedding_bag_compiled_forward_and_backward():
    indices = torch.tensor([1, 2, 4, 5, 2, 3, 2, 9, 2, 2, 7, 7])
    offsets = torch.tensor([0, 2, 2, 5, 8])
    for mode, last, psw in (("sum", False, False), ("sum", True, True), ("mean", False, False),
                            ("mean", True, False), ("max", False, False)):
        torch.manual_seed(2)
        cpu = nn.EmbeddingBag(10, 4, mode=mode, include_last_offset=last)
        tpu = copy.deepcopy(cpu).to("tpu")
        offs = torch.cat([offsets, torch.tensor([indices.numel()])]) if last else offsets
        weights = torch.linspace(0.5, 2, indices.numel()) if psw else None

        def run(model, device, compile_it):
            fn = torch.compile(model, backend="tpu", dynamic=False) if compile_it else model
            w = weights.to(device) if psw else None
            out = fn(indices.to(device), offs.to(device), per_sample_weights=w)
            (out * torch.arange(out.numel(), dtype=out.dtype, device=device).reshape(out.shape).sin()).sum().backward()
            return out

        expected = run(cpu, "cpu", False)
        actual = run(tpu, "tpu", True)
        torch.testing.assert_close(actual.cpu(), expected, rtol=1e-5, atol=1e-6, msg=mode)
        torch.testing.assert_close(tpu.weight.grad.cpu(), cpu.weight.grad, rtol=1e-5, atol=1e-6, msg=mode)
