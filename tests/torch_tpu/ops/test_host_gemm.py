"""The 2-D GEMM kernel on torch's MKL (torch_tpu/ops/host_gemm.py) against CPU torch's mm: every
transpose combination, bfloat16 with float32 accumulation, gradients, a linear layer's graph passing
``weight.t()`` as a flag, the plain dot for small products, and the switch."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import torch_tpu  # noqa: F401  (registers the tpu device)
from torch_tpu.ops.host_gemm import MIN_MACS, gemm, kernel_available
from torch_tpu.runtime._jax import jax, jnp

pytestmark = pytest.mark.skipif(not kernel_available(), reason="no C++ compiler or MKL: the kernel is not built")


@pytest.fixture(autouse=True)
def one_cpu():
    """The kernel is in use where the process is bound to one CPU (a rank of several on a host)."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    yield allowed
    os.sched_setaffinity(0, allowed)

SHAPES = [(256, 1024, 512), (512, 300, 64), (70, 3000, 33)]  # m, k, n: tower layers, a ragged one


def _operands(m, k, n, trans_a, trans_b, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(*((k, m) if trans_a else (m, k)), generator=g).to(dtype)
    b = torch.randn(*((n, k) if trans_b else (k, n)), generator=g).to(dtype)
    return a, b


def _jax(t: torch.Tensor) -> jax.Array:
    return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16 if t.dtype == torch.bfloat16 else jnp.float32)


def _op(t, transposed):
    return t.T if transposed else t


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_float32_matches_torch_mm(shape, trans_a, trans_b) -> None:
    a, b = _operands(*shape, trans_a, trans_b)
    program = jax.jit(gemm, static_argnums=(2, 3))
    assert "TorchTpuHostGemmF32" in program.lower(_jax(a), _jax(b), trans_a, trans_b).as_text()
    got = np.asarray(program(_jax(a), _jax(b), trans_a, trans_b))
    np.testing.assert_allclose(got, (_op(a, trans_a) @ _op(b, trans_b)).numpy(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, True)])
def test_bfloat16_products_accumulate_in_float32(trans_a, trans_b) -> None:
    """bf16 operands: the float32 product of their values, unrounded (the caller rounds once)."""
    a, b = _operands(128, 512, 96, trans_a, trans_b, dtype=torch.bfloat16, seed=1)
    got = jax.jit(gemm, static_argnums=(2, 3))(_jax(a), _jax(b), trans_a, trans_b)
    assert got.dtype == jnp.float32
    exact = (_op(a, trans_a).double() @ _op(b, trans_b).double()).numpy()
    np.testing.assert_allclose(np.asarray(got), exact, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("trans_a,trans_b", [(False, True), (True, False)])
def test_gradients_match_torch_autograd(trans_a, trans_b) -> None:
    a, b = _operands(96, 600, 80, trans_a, trans_b, seed=2)
    weight = torch.randn(96, 80, generator=torch.Generator().manual_seed(3))
    ta, tb = a.clone().requires_grad_(), b.clone().requires_grad_()
    ((_op(ta, trans_a) @ _op(tb, trans_b)) * weight).sum().backward()

    def loss(x, y):
        return (gemm(x, y, trans_a, trans_b) * _jax(weight)).sum()

    grad_a, grad_b = jax.jit(jax.grad(loss, argnums=(0, 1)))(_jax(a), _jax(b))
    np.testing.assert_allclose(np.asarray(grad_a), ta.grad.numpy(), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(grad_b), tb.grad.numpy(), rtol=1e-5, atol=1e-4)


def test_a_process_with_several_cpus_keeps_xla_s_dot(one_cpu) -> None:
    big = jnp.ones((256, 1024), jnp.float32)
    os.sched_setaffinity(0, one_cpu)
    lowered = jax.jit(lambda v: gemm(v, v, False, True)).lower(big).as_text()
    assert ("TorchTpuHostGemm" in lowered) is (len(one_cpu) == 1)


def test_small_products_and_other_platforms_keep_xla_s_dot() -> None:
    small = jnp.ones((8, 8), jnp.float32)
    assert 8 * 8 * 8 < MIN_MACS
    assert "TorchTpuHostGemm" not in jax.jit(lambda v: gemm(v, v)).lower(small).as_text()
    big = jnp.ones((256, 1024), jnp.float32)
    tpu = jax.jit(lambda v: gemm(v, v, False, True)).trace(big).lower(lowering_platforms=("tpu",)).as_text()
    assert "TorchTpuHostGemm" not in tpu and "dot_general" in tpu


def test_a_linear_layer_graph_passes_the_weight_transpose_as_a_flag() -> None:
    """``aten.addmm(bias, x, weight.t())`` and its backward ``mm``s in a compiled graph: one GEMM
    call each, no transpose in the program, values of CPU torch's autograd."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_tpu.compile.program.fx_to_jax import to_jax_function

    def layer(x, weight, bias, grad):
        out = torch.nn.functional.linear(x, weight, bias)
        return out, grad.t() @ x, grad @ weight

    g = torch.Generator().manual_seed(4)
    x, weight, bias, grad = (torch.randn(*s, generator=g) for s in ((512, 256), (128, 256), (128,), (512, 128)))
    gm = make_fx(layer, tracing_mode="fake")(x, weight, bias, grad)
    program = jax.jit(to_jax_function(gm))
    compiled = program.lower(*map(_jax, (x, weight, bias, grad))).compile().as_text()
    assert compiled.count("TorchTpuHostGemmF32") == 3 and "transpose(" not in compiled
    for got, expected in zip(program(*map(_jax, (x, weight, bias, grad))), layer(x, weight, bias, grad)):
        np.testing.assert_allclose(np.asarray(got), expected.numpy(), rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_the_kernel_can_be_switched_off() -> None:
    code = ("import os, torch_tpu\nfrom torch_tpu.ops import host_gemm\nfrom torch_tpu.runtime._jax import jax, jnp\n"
            "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "x = jnp.ones((256, 1024))\nprint('kernel', host_gemm.kernel_available(),"
            " 'TorchTpuHostGemm' in jax.jit(lambda v: host_gemm.gemm(v, v, False, True)).lower(x).as_text())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TORCH_TPU_HOST_GEMM": "0"})
    assert done.returncode == 0, done.stderr
    assert "kernel False False" in done.stdout
