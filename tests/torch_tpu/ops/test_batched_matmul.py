"""The CPU batched-matmul kernel (torch_tpu/ops/batched_matmul.py) against CPU torch's bmm: every
transpose combination, shapes around the kernel's tiling (rows of 8, panels of 32 columns, the
16 x 16 transposed packing), bfloat16 with float32 accumulation, gradients, the device's ``bmm``
eager and compiled, and the plain dot where the kernel does not apply."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import torch_tpu  # noqa: F401  (registers the tpu device)
from torch_tpu.ops.batched_matmul import MAX_DIM, batched_matmul, kernel_available
from torch_tpu.runtime._jax import jax, jnp

pytestmark = pytest.mark.skipif(not kernel_available(), reason="no C++ compiler: the kernel is not built")

SHAPES = [  # batch, m, n, k
    (2048, 27, 27, 64),  # DLRM's interaction at the anchor
    (3, 1, 1, 1),
    (5, 9, 33, 16),  # a row block of 8 plus one row; two column panels, the second ragged
    (4, 17, 64, 27),  # whole panels read in place; k not a multiple of 16
    (7, 8, 31, 48),
    (2, 30, 70, 0),  # empty contraction: zeros
    (0, 4, 4, 4),
]


def _operands(batch, m, n, k, trans_a, trans_b, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(batch, *((k, m) if trans_a else (m, k)), generator=g).to(dtype)
    b = torch.randn(batch, *((n, k) if trans_b else (k, n)), generator=g).to(dtype)
    return a, b


def _torch_product(a, b, trans_a, trans_b):
    return torch.bmm(a.transpose(1, 2) if trans_a else a, b.transpose(1, 2) if trans_b else b)


def _jax(t: torch.Tensor) -> jax.Array:
    return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16 if t.dtype == torch.bfloat16 else jnp.float32)


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_float32_matches_torch_bmm(shape, trans_a, trans_b) -> None:
    a, b = _operands(*shape, trans_a, trans_b)
    got = np.asarray(jax.jit(batched_matmul, static_argnums=(2, 3))(_jax(a), _jax(b), trans_a, trans_b))
    expected = _torch_product(a, b, trans_a, trans_b).numpy()
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * max(1, shape[3]) ** 0.5)


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False), (True, True)])
def test_bfloat16_accumulates_in_float32(trans_a, trans_b) -> None:
    """bf16 operands: the float32 product of the bf16 values, rounded once to bf16 (as torch's
    CPU bmm): at most one bf16 rounding (2^-8 relative) from it."""
    a, b = _operands(64, 27, 27, 64, trans_a, trans_b, dtype=torch.bfloat16, seed=1)
    got = jax.jit(batched_matmul, static_argnums=(2, 3))(_jax(a), _jax(b), trans_a, trans_b)
    assert got.dtype == jnp.bfloat16
    exact = _torch_product(a.float(), b.float(), trans_a, trans_b)
    got = torch.from_numpy(np.asarray(got.astype(jnp.float32)))
    assert torch.all((got - exact).abs() <= exact.abs() * 2**-8 + 1e-6)
    torch.testing.assert_close(got, _torch_product(a, b, trans_a, trans_b).float(), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False), (True, True)])
def test_gradients_match_torch_autograd(trans_a, trans_b) -> None:
    a, b = _operands(6, 11, 37, 32, trans_a, trans_b, seed=2)
    weight = torch.randn(6, 11, 37, generator=torch.Generator().manual_seed(3))
    ta, tb = a.clone().requires_grad_(), b.clone().requires_grad_()
    (_torch_product(ta, tb, trans_a, trans_b) * weight).sum().backward()

    def loss(x, y):
        return jnp.sum(batched_matmul(x, y, trans_a, trans_b) * jnp.asarray(weight.numpy()))

    grad_a, grad_b = jax.jit(jax.grad(loss, argnums=(0, 1)))(_jax(a), _jax(b))
    np.testing.assert_allclose(np.asarray(grad_a), ta.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grad_b), tb.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_the_cpu_lowering_calls_the_kernel_and_a_tpu_lowering_keeps_the_dot() -> None:
    x = jnp.ones((4, 27, 64), jnp.float32)
    product = jax.jit(lambda v: batched_matmul(v, v, False, True))
    assert "TorchTpuBatchedMatmulF32" in product.lower(x).as_text()
    exported = jax.export.export(product, platforms=["tpu"])(x)
    assert "TorchTpuBatchedMatmul" not in exported.mlir_module()
    assert "dot_general" in exported.mlir_module()


def test_large_products_and_other_dtypes_keep_xla_s_dot() -> None:
    big = jnp.ones((2, MAX_DIM + 1, 8), jnp.float32)
    assert "TorchTpuBatchedMatmul" not in jax.jit(lambda v: batched_matmul(v, v, False, True)).lower(big).as_text()
    halves = jnp.ones((2, 4, 8), jnp.float16)
    text = jax.jit(lambda v: batched_matmul(v, v, False, True)).lower(halves).as_text()
    assert "TorchTpuBatchedMatmul" not in text


def test_bad_operands_are_named() -> None:
    with pytest.raises(ValueError, match=r"shapes \(2, 3, 4\) and \(2, 5, 6\) do not multiply"):
        batched_matmul(jnp.ones((2, 3, 4)), jnp.ones((2, 5, 6)))
    with pytest.raises(TypeError, match="expected 3-D operands, got 2-D"):
        batched_matmul(jnp.ones((3, 4)), jnp.ones((2, 4, 6)))
    with pytest.raises(TypeError, match="one dtype"):
        batched_matmul(jnp.ones((2, 3, 4)), jnp.ones((2, 4, 6), jnp.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_bmm_forward_and_backward_eager_and_compiled(dtype) -> None:
    """DLRM's interaction (c @ c^T) on the tpu device, eager and under torch.compile, against CPU."""
    g = torch.Generator().manual_seed(4)
    combined = torch.randn(32, 27, 64, generator=g).to(dtype)
    weight = torch.randn(32, 27, 27, generator=g).to(dtype)

    def step(c, w):
        c = c.clone().requires_grad_()
        out = torch.bmm(c, c.transpose(1, 2))
        (out.float() * w.float()).sum().backward()
        return out, c.grad

    expected = step(combined, weight)
    tolerance = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    for run in (step, torch.compile(step, backend="tpu", dynamic=False)):
        got = run(combined.to("tpu"), weight.to("tpu"))
        for g_, e in zip(got, expected):
            assert g_.dtype == e.dtype
            torch.testing.assert_close(g_.cpu().float(), e.float(), **tolerance)


def _run_isolated(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


CHECK = """
import warnings; warnings.simplefilter("always")
import torch, torch_tpu
from torch_tpu.ops.batched_matmul import kernel_available
a = torch.randn(8, 27, 64)
got = torch.bmm(a.to("tpu"), a.to("tpu").transpose(1, 2)).cpu()
torch.testing.assert_close(got, torch.bmm(a, a.transpose(1, 2)))
print("kernel", kernel_available())
"""


def test_without_a_compiler_bmm_falls_back_to_the_dot_with_one_warning(tmp_path) -> None:
    done = _run_isolated(CHECK, CXX=str(tmp_path / "no-such-compiler"), TORCHREC_TPU_NATIVE_CACHE=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "kernel False" in done.stdout
    assert done.stderr.count("batched-matmul kernel is unavailable") == 1, done.stderr


@pytest.mark.slow
def test_the_kernel_can_be_switched_off() -> None:
    done = _run_isolated(CHECK, TORCH_TPU_BMM_KERNEL="0")
    assert done.returncode == 0, done.stderr
    assert "kernel False" in done.stdout


def _bmm_graph(transposes: str) -> torch.fx.GraphModule:
    """An aten graph of DLRM's interaction and its two gradient products as AOTAutograd writes them:
    ``c @ c^T``, ``c^T @ g`` and ``g @ (c^T)^T``, the swaps as ``transposes`` ("permute" or "transpose")."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def swap(x):
        return x.permute(0, 2, 1) if transposes == "permute" else x.transpose(-1, 1)

    def interaction(c, g):
        ct = swap(c)
        return torch.bmm(c, ct), torch.bmm(swap(c), g), torch.bmm(g, swap(ct))

    return make_fx(interaction, tracing_mode="fake")(torch.empty(64, 27, 16), torch.empty(64, 27, 27))


@pytest.mark.parametrize("transposes", ["permute", "transpose"])
def test_graph_bmm_takes_permuted_operands_as_flags(transposes) -> None:
    """In a compiled graph a bmm of operands swapped in their last two dims multiplies them in place:
    no transpose in the program, and the same bits as the products of the swapped copies."""
    from torch_tpu.compile.program.fx_to_jax import to_jax_function

    gm = _bmm_graph(transposes)
    g = torch.Generator().manual_seed(5)
    c, w = torch.randn(64, 27, 16, generator=g), torch.randn(64, 27, 27, generator=g)
    program = jax.jit(to_jax_function(gm))
    compiled = program.lower(_jax(c), _jax(w)).compile().as_text()
    assert "transpose" not in compiled and compiled.count("TorchTpuBatchedMatmulF32") == 3
    got = [np.asarray(v) for v in program(_jax(c), _jax(w))]

    def copies(x):
        return jnp.swapaxes(x, 1, 2)

    zc, zw = _jax(c), _jax(w)
    unfolded = [batched_matmul(zc, copies(zc)), batched_matmul(copies(zc), zw), batched_matmul(zw, copies(copies(zc)))]
    for value, reference in zip(got, unfolded):
        np.testing.assert_array_equal(value, np.asarray(reference))
    expected = (torch.bmm(c, c.transpose(1, 2)), torch.bmm(c.transpose(1, 2), w), torch.bmm(w, c))
    for value, e in zip(got, expected):
        np.testing.assert_allclose(value, e.numpy(), rtol=1e-5, atol=1e-5)
