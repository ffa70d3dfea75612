"""torch.compile(backend="tpu") equals CPU eager torch: forward, grads, several optimizer steps."""

import copy

import pytest
import torch
import torch.nn.functional as F

import torch_tpu.compile as tc
from tests.torch_tpu.compile.models import DCN, DLRMDense, mlp

B = 8


def _inputs(name: str, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    if name == "mlp":
        return (torch.randn(B, 12, generator=gen),)
    if name == "dlrm":
        return torch.randn(B, 13, generator=gen), torch.randn(B, 4, 16, generator=gen)
    return (torch.randn(B, 24, generator=gen),)


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return {"mlp": lambda: mlp([12, 32, 16, 1]), "dlrm": DLRMDense, "dcn": DCN}[name]()


def _step(model, opt, y, *x):
    """Forward, BCE loss, backward and optimizer step: what the tests compile as one function."""
    loss = F.binary_cross_entropy_with_logits(model(*x).reshape(-1), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("name", ["mlp", "dlrm", "dcn"])
def test_inference_matches_eager(name):
    model = _model(name).eval()
    x = _inputs(name, torch.Generator().manual_seed(1))
    compiled = torch.compile(model, backend="tpu", dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*x), model(*x))
    assert tc.compile_stats().graphs == 1
    assert [g.kind for g in tc.compiled_graphs()] == ["inference"]


@pytest.mark.parametrize(
    "name,optimizer",
    [("mlp", torch.optim.SGD), ("dlrm", torch.optim.Adagrad), ("dcn", torch.optim.Adam)],
)
def test_training_steps_match_eager(name, optimizer):
    """Forward + backward + optimizer step compiled as one function, 3 steps, vs eager."""
    eager = _model(name)
    compiled_model = copy.deepcopy(eager)
    opt_eager = optimizer(eager.parameters(), lr=0.05)
    opt_compiled = optimizer(compiled_model.parameters(), lr=0.05)

    compiled_step = torch.compile(_step, backend="tpu", dynamic=False)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = _inputs(name, gen)
        y = torch.rand(B, generator=gen).round()
        torch.testing.assert_close(compiled_step(compiled_model, opt_compiled, y, *x), _step(eager, opt_eager, y, *x))
        for (pname, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
            torch.testing.assert_close(q, p, msg=lambda m: f"{name} parameter {pname}: {m}")
    kinds = sorted({g.kind for g in tc.compiled_graphs()})
    assert kinds == ["backward", "forward", "inference"]  # model fwd/bwd + the optimizer step graph


def test_gradients_match_eager():
    model = _model("dlrm")
    twin = copy.deepcopy(model)
    x = _inputs("dlrm", torch.Generator().manual_seed(3))
    torch.compile(twin, backend="tpu", dynamic=False)(*x).square().sum().backward()
    model(*x).square().sum().backward()
    for (pname, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m: f"grad of {pname}: {m}")


def test_dropout_uses_device_random_stream():
    """Random ops draw a fresh key per call: two calls differ, the mask keeps torch's scaling."""
    f = torch.compile(lambda x: F.dropout(x, p=0.5, training=True), backend="tpu", dynamic=False)
    x = torch.ones(64, 64)
    a, b = f(x), f(x)
    assert not torch.equal(a, b)
    assert set(torch.unique(a).tolist()) <= {0.0, 2.0}
    assert 0.4 < (a == 0).float().mean().item() < 0.6


def test_unlowered_op_is_named():
    f = torch.compile(lambda x: torch.special.bessel_j0(x) + 1, backend="tpu", dynamic=False)
    with pytest.raises(Exception, match="no JAX lowering for aten.special_bessel_j0"):
        f(torch.randn(4))


def _on_tpu(tensors):
    return tuple(t.to("tpu") for t in tensors)


@pytest.mark.parametrize("name", ["mlp", "dcn"])
def test_tpu_tensor_inference_matches_cpu_eager(name):
    model = _model(name).eval()
    x = _inputs(name, torch.Generator().manual_seed(4))
    compiled = torch.compile(copy.deepcopy(model).to("tpu"), backend="tpu", dynamic=False)
    with torch.no_grad():
        out = compiled(*_on_tpu(x))
        assert out.device == torch.device("tpu", 0)
        torch.testing.assert_close(out.cpu(), model(*x))


def test_tpu_tensor_training_steps_match_cpu_eager():
    """DLRM with Adagrad on tpu tensors, compiled fwd+bwd+step, vs CPU eager; no CPU fallbacks."""
    import torch_tpu

    eager = _model("dlrm")
    on_tpu = copy.deepcopy(eager).to("tpu")
    opt_eager = torch.optim.Adagrad(eager.parameters(), lr=0.05)
    opt_tpu = torch.optim.Adagrad(on_tpu.parameters(), lr=0.05)

    compiled_step = torch.compile(_step, backend="tpu", dynamic=False)
    gen = torch.Generator().manual_seed(5)
    torch_tpu.reset_metrics()
    for _ in range(3):
        x = _inputs("dlrm", gen)
        y = torch.rand(B, generator=gen).round()
        loss = compiled_step(on_tpu, opt_tpu, y.to("tpu"), *_on_tpu(x))
        torch.testing.assert_close(loss.cpu(), _step(eager, opt_eager, y, *x))
        for (pname, p), q in zip(eager.named_parameters(), on_tpu.parameters()):
            assert q.device == torch.device("tpu", 0)
            torch.testing.assert_close(q.detach().cpu(), p.detach(), msg=lambda m: f"parameter {pname}: {m}")
    assert torch_tpu.fallback_counts() == {}
