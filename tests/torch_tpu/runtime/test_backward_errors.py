"""Exceptions raised on the tpu device during backward reach ``loss.backward()`` as themselves
(not a process abort, not ``SystemError: run_backward returned NULL``), with autograd's device
threads on and off."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import torch_tpu
from torch_tpu.eager import dispatch
from torch_tpu.ops import registry

aten = torch.ops.aten
# forward falls back to CPU; its backward op has neither a lowering nor a torch._decomp entry
UNLOWERED_BACKWARD = aten.multi_margin_loss_backward.default


@pytest.fixture(params=[True, False], ids=["device_threads", "single_thread"])
def multithreading(request):
    previous = torch.autograd.is_multithreading_enabled()
    torch.autograd.set_multithreading_enabled(request.param)
    yield
    torch.autograd.set_multithreading_enabled(previous)


def _margin_loss(device):
    torch.manual_seed(0)
    x = torch.randn(3, 4).to(device).requires_grad_(True)
    return x, F.multi_margin_loss(x * 1, torch.tensor([0, 2, 1], device=device))


def test_unlowered_op_in_backward_raises_fallback_error(multithreading):
    assert torch_tpu.get_lowering(UNLOWERED_BACKWARD) is None
    x, loss = _margin_loss("tpu")
    with torch_tpu.no_fallback():
        with pytest.raises(torch_tpu.TpuFallbackError, match="multi_margin_loss_backward"):
            loss.backward(retain_graph=True)
        with pytest.raises(torch_tpu.TpuFallbackError, match="multi_margin_loss_backward"):
            torch.autograd.grad(loss, x, retain_graph=True)
    # the process and the graph are intact: the same backward runs with fallback allowed
    loss.backward()
    x_cpu, loss_cpu = _margin_loss("cpu")
    loss_cpu.backward()
    torch.testing.assert_close(x.grad.cpu(), x_cpu.grad)


def test_exception_in_backward_lowering_names_the_op(multithreading, monkeypatch):
    op = aten.threshold_backward.default  # relu's backward

    def failing(*args, **kwargs):
        raise RuntimeError("lowering exploded")

    monkeypatch.setitem(registry._TABLE, op, registry.Lowering(op, failing))
    dispatch.clear_handler_cache()
    try:
        x = torch.randn(5, device="tpu", requires_grad=True)
        with pytest.raises(RuntimeError, match="lowering exploded") as info:
            torch.relu(x).sum().backward()
        assert any("aten.threshold_backward.default" in note for note in info.value.__notes__)
    finally:
        monkeypatch.undo()
        dispatch.clear_handler_cache()
    torch.relu(x).sum().backward()  # the real lowering is back
    assert x.grad.cpu().tolist() == (x.detach().cpu() > 0).float().tolist()


def test_exceptions_in_hooks_and_functions_reach_backward(multithreading):
    x = torch.randn(3, device="tpu", requires_grad=True)

    def bad_hook(grad):
        raise ValueError("tensor hook failed")

    y = x * 2
    y.register_hook(bad_hook)
    with pytest.raises(ValueError, match="tensor hook failed"):
        (y * 3).sum().backward()

    def bad_post_hook(param):
        raise KeyError("post-accumulate hook failed")

    handle = x.register_post_accumulate_grad_hook(bad_post_hook)
    with pytest.raises(KeyError, match="post-accumulate hook failed"):
        (x * 3).sum().backward()
    handle.remove()

    class Failing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, grad):
            return torch.cummax(grad, 0).values  # unlowered: falls back, here forbidden

    with torch_tpu.no_fallback(), pytest.raises(torch_tpu.TpuFallbackError, match="cummax"):
        Failing.apply(x).sum().backward()


_SCRIPT = textwrap.dedent("""
    import sys, torch, torch_tpu
    import torch.nn.functional as F
    assert not torch_tpu.fallback_allowed()  # TORCH_TPU_NO_FALLBACK=1
    if sys.argv[1] == "single_thread":
        torch.autograd.set_multithreading_enabled(False)
    x = torch.randn(3, 4, device="tpu", requires_grad=True)
    torch_tpu.set_fallback_allowed(True)
    loss = F.multi_margin_loss(x * 1, torch.tensor([0, 2, 1], device="tpu"))
    torch_tpu.set_fallback_allowed(False)
    loss.backward()  # uncaught: a normal traceback and exit status 1
""")


@pytest.mark.parametrize("mode", ["device_threads", "single_thread"])
def test_no_fallback_env_in_backward_exits_with_a_traceback_not_an_abort(mode):
    env = dict(os.environ, TORCH_TPU_NO_FALLBACK="1")
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    assert "terminate called" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("torch_tpu.eager.fallback.TpuFallbackError: aten.multi_margin_loss_backward.default"), last
