"""Dynamic dims never fail under torch.compile(backend="tpu"): one program per concrete shape."""

import copy
import logging

import torch
from torch import nn

from tests.compile.models import mlp
from torch_tpu.compile import specialize


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


def test_marked_dynamic_dim_specializes_per_shape_and_warns(caplog, monkeypatch):
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
