"""Dtype edge cases of lowerings, vs CPU torch or a float64 reference: bool scatters, bfloat16
accumulation (computed in float32 like torch's kernels), layer norm precision."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_tpu  # noqa: F401

INDEX = torch.tensor([[0, 2, 1, 0, 3], [1, 2, 3, 3, 0], [3, 3, 1, 2, 0]])
ROWS = torch.tensor([0, 2, 0])

BOOL_UPDATES = {
    "scatter_add": lambda x, s: torch.scatter_add(x, 0, INDEX.to(x.device), s[:3]),
    "scatter_reduce_sum": lambda x, s: torch.scatter_reduce(x, 0, INDEX.to(x.device), s[:3], "sum"),
    "scatter_reduce_prod": lambda x, s: torch.scatter_reduce(x, 0, INDEX.to(x.device), s[:3], "prod"),
    "scatter_reduce_amax_no_self": lambda x, s: torch.scatter_reduce(
        x, 0, INDEX.to(x.device), s[:3], "amax", include_self=False),
    "scatter_reduce_amin_no_self": lambda x, s: torch.scatter_reduce(
        x, 0, INDEX.to(x.device), s[:3], "amin", include_self=False),
    "index_put_accumulate": lambda x, s: x.index_put((ROWS.to(x.device),), s[:3], accumulate=True),
    "index_add": lambda x, s: x.index_add(0, ROWS.to(x.device), s[:3]),
    "index_add_alpha": lambda x, s: x.index_add(0, ROWS.to(x.device), s[:3], alpha=True),
    "index_put_": lambda x, s: x.index_put_((ROWS.to(x.device),), s[:3], accumulate=True),
}


@pytest.mark.parametrize("name", sorted(BOOL_UPDATES))
def test_bool_scatters_match_cpu(name):
    gen = torch.Generator().manual_seed(0)
    x, src = torch.rand(4, 5, generator=gen) > 0.5, torch.rand(4, 5, generator=gen) > 0.5
    expected = BOOL_UPDATES[name](x.clone(), src)
    actual = BOOL_UPDATES[name](x.to("tpu"), src.to("tpu"))
    assert actual.dtype == torch.bool
    torch.testing.assert_close(actual.cpu(), expected, rtol=0, atol=0)


BF16_OPS = {
    "sum": lambda x: x.sum(),
    "sum_dim": lambda x: x.sum(1),
    "mean": lambda x: x.mean(),
    "cumsum": lambda x: x.cumsum(1)[:, -1],
    "var": lambda x: x.var(1),
    "std": lambda x: x.std(),
    "norm": lambda x: torch.linalg.vector_norm(x),
    "logsumexp": lambda x: torch.logsumexp(x, 1),
    "softmax": lambda x: F.softmax(x, 1)[:, :3],
    "addcdiv": lambda x: torch.addcdiv(x, x, x + 3, value=0.5).sum(1),
}


@pytest.mark.parametrize("name", sorted(BF16_OPS))
def test_bfloat16_accumulates_in_float32(name):
    # 4096 values of ~0.1: accumulating in bfloat16 stalls at 32 (0.1 < half an ulp), float32 does not
    gen = torch.Generator().manual_seed(0)
    x = (0.1 + 0.01 * torch.rand(2, 4096, generator=gen)).bfloat16()
    precise = BF16_OPS[name](x.double())
    actual = BF16_OPS[name](x.to("tpu"))
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.cpu().double(), precise, rtol=2**-8, atol=1e-6)


def _layer_norm_step(x, w, b, dy):
    x, w, b = (t.detach().requires_grad_() for t in (x, w, b))
    out, mean, rstd = torch.ops.aten.native_layer_norm(x, [x.shape[-1]], w, b, 1e-5)
    grads = torch.autograd.grad(out, (x, w, b), dy)
    return [out, mean, rstd, *grads]


@pytest.mark.parametrize("dtype,weight_dtype,rtol", [(torch.float32, torch.float32, 1e-5),
                                                     (torch.bfloat16, torch.bfloat16, 2**-7),
                                                     (torch.bfloat16, torch.float32, 2**-7)], ids=str)
def test_layer_norm_matches_float64_reference(dtype, weight_dtype, rtol):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 32, generator=gen) * 3 + 5
    x[0] = 4.25  # zero variance: CPU's float32 backward cancels catastrophically here
    x, dy = x.to(dtype), torch.randn(6, 32, generator=gen).to(dtype)
    w, b = (torch.randn(32, generator=gen).to(weight_dtype) for _ in range(2))
    reference = _layer_norm_step(*(t.double() for t in (x, w, b, dy)))
    cpu_dtypes = [t.dtype for t in _layer_norm_step(x, w, b, dy)]
    actual = _layer_norm_step(*(t.to("tpu") for t in (x, w, b, dy)))
    for a, r, want in zip(actual, reference, cpu_dtypes):
        assert a.dtype == want
        scale = r.abs().max().item()
        torch.testing.assert_close(a.cpu().double(), r, rtol=rtol, atol=rtol * scale)


ADD_PRODUCTS = {
    "addmm": (torch.addmm, [(48, 40), (48, 96), (96, 40)]),
    "addmm_broadcast": (torch.addmm, [(40,), (48, 96), (96, 40)]),
    "baddbmm": (torch.baddbmm, [(3, 16, 24), (3, 16, 96), (3, 96, 24)]),
    "addmv": (torch.addmv, [(48,), (48, 96), (96,)]),
}


@pytest.mark.parametrize("beta,alpha", [(1, 1), (-0.7, 1.3), (0, 2.1)], ids=str)
@pytest.mark.parametrize("name", sorted(ADD_PRODUCTS))
def test_half_precision_products_with_alpha_and_beta_round_once(name, beta, alpha):
    """``beta * input + alpha * (a @ b)`` in bfloat16: CPU computes it all in float32 and rounds once;
    rounding the product, the scaled terms and the sum each to bfloat16 is several ulps off."""
    op, shapes = ADD_PRODUCTS[name]
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(*s, generator=gen).bfloat16() for s in shapes]
    once = op(*(a.float() for a in args), beta=beta, alpha=alpha).bfloat16()
    if name != "addmv":  # CPU's bfloat16 gemv takes a path of its own; its gemm rounds exactly once
        torch.testing.assert_close(op(*args, beta=beta, alpha=alpha), once, rtol=0, atol=0)
    actual = op(*(a.to("tpu") for a in args), beta=beta, alpha=alpha)
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.cpu(), once, rtol=0, atol=0)
    if args[0].shape == actual.shape:  # in place (a broadcast input cannot hold the result)
        inplace = args[0].to("tpu")
        getattr(inplace, f"{op.__name__}_")(*(a.to("tpu") for a in args[1:]), beta=beta, alpha=alpha)
        torch.testing.assert_close(inplace.cpu(), actual.cpu(), rtol=0, atol=0)


ALPHA_OPS = {
    "add": lambda a, b, s: torch.add(a, b, alpha=s),
    "add_scalar": lambda a, b, s: torch.add(a, 1.1, alpha=s),
    "add_": lambda a, b, s: a.clone().add_(b, alpha=s),
    "sub": lambda a, b, s: torch.sub(a, b, alpha=s),
    "rsub": lambda a, b, s: torch.rsub(a, b, alpha=s),
    "lerp_scalar": lambda a, b, s: torch.lerp(a, b, s / 3),
    "lerp_tensor": lambda a, b, s: torch.lerp(a, b, (b - a).abs() / 8),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", sorted(ALPHA_OPS))
def test_half_precision_elementwise_scales_round_once_as_cpu(name, dtype):
    """CPU computes ``a + alpha * b`` (alpha taken in the tensor's dtype) and lerp in float32 and
    rounds once; rounding the product and then the sum was an ulp off in a third of the elements.
    Several scales: after a few the op cache traces them as inputs instead of constants."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(2048, generator=gen).to(dtype) for _ in range(2))
    for scale in (1.3, 0.7, 2.9, 0.3, 1.7):
        expected = ALPHA_OPS[name](a, b, scale)
        actual = ALPHA_OPS[name](a.to("tpu"), b.to("tpu"), scale)
        assert actual.dtype == dtype
        torch.testing.assert_close(actual.cpu(), expected, rtol=0, atol=0, msg=lambda m: f"scale {scale}: {m}")
