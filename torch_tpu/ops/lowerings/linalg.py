"""Matrix-product lowerings. Their dots take the device's matmul precision (``torch.tpu.precision``,
``torch.set_float32_matmul_precision``: HIGHEST by default, so TPU float32 results match CPU fp32):
no precision is pinned here, JAX's ``default_matmul_precision`` (set by
``torch_tpu.runtime.precision``) applies when the op is traced. Half-precision products accumulate
in float32 and round once (``batched_matmul.matmul``), as CPU torch's do."""

from __future__ import annotations

import torch

from torch_tpu.ops import host_gemm
from torch_tpu.ops.batched_matmul import ACCUMULATE_IN_F32, batched_matmul, matmul
from torch_tpu.ops.lowerings._common import cast, is_one
from torch_tpu.ops.registry import register_lowering
from torch_tpu.runtime._jax import jnp

aten = torch.ops.aten


def _same_dtype(op: str, a, b) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{op}: expected both operands to have the same dtype, got {a.dtype} and {b.dtype}")


def _check_rank(op: str, x, rank: int) -> None:
    if x.ndim != rank:
        raise TypeError(f"{op}: expected a {rank}-D tensor, got {x.ndim}-D")


def _checked_matmul(name: str, ranks: tuple[int, int]):
    def lowering(self, other):
        _check_rank(name, self, ranks[0]), _check_rank(name, other, ranks[1]), _same_dtype(name, self, other)
        return matmul(self, other)

    return lowering


@register_lowering(aten.mm.default)
def mm(self, mat2):
    """2-D products through ``host_gemm``: MKL's GEMM on XLA:CPU, the plain dot elsewhere."""
    return mm_transposed(self, mat2, False, False)


def mm_transposed(a, b, trans_a: bool, trans_b: bool, accumulated: bool = False):
    """``aten.mm`` of ``op(a)`` and ``op(b)`` (a graph's mm of a transposed operand passes the
    transpose as a flag). ``accumulated``: a half-precision product is returned in float32, unrounded."""
    _check_rank("mm", a, 2), _check_rank("mm", b, 2), _same_dtype("mm", a, b)
    if host_gemm.applies(a, b):
        out = host_gemm.gemm(a, b, trans_a, trans_b)
    else:
        wide = jnp.float32 if a.dtype in ACCUMULATE_IN_F32 else None
        out = jnp.matmul(a.T if trans_a else a, b.T if trans_b else b, preferred_element_type=wide)
    return out if accumulated else out.astype(a.dtype)


@register_lowering(aten.bmm.default)
def bmm(self, mat2):
    """Batched products through ``batched_matmul``: a fast kernel on XLA:CPU, the plain dot elsewhere."""
    return bmm_transposed(self, mat2, False, False)


def bmm_transposed(a, b, trans_a: bool, trans_b: bool):
    """``aten.bmm`` of ``op(a)`` and ``op(b)``, ``op`` swapping the last two dims where its flag is set:
    a graph's bmm of a permuted operand passes the permute as a flag (no transposed copy)."""
    _check_rank("bmm", a, 3), _check_rank("bmm", b, 3), _same_dtype("bmm", a, b)
    return batched_matmul(a, b, trans_a, trans_b)


mv = register_lowering(aten.mv.default)(_checked_matmul("mv", (2, 1)))


@register_lowering(aten.dot.default)
def dot(self, tensor):
    _check_rank("dot", self, 1), _check_rank("dot", tensor, 1), _same_dtype("dot", self, tensor)
    return matmul(self, tensor)


def _beta_alpha(op: str, input, a, b, product, beta, alpha):
    """``beta * input + alpha * product(a, b)``. Half-precision operands: the product accumulated,
    scaled and summed in float32 and rounded once, as CPU torch's gemm does (rounding each step
    compounds: Muon's Newton-Schulz iterations drift by percents)."""
    _same_dtype(op, input, a), _same_dtype(op, a, b)
    if input.dtype in ACCUMULATE_IN_F32:
        return _scaled_sum(input, jnp.matmul(a, b, preferred_element_type=jnp.float32), beta, alpha)
    return _scaled_sum(input, product(a, b), beta, alpha)


def _scaled_sum(input, out, beta, alpha):
    """``beta * input + alpha * out`` with ``out`` the product (float32 for a half-precision
    ``input``), rounded once to ``input``'s dtype."""
    dtype = input.dtype
    input = input.astype(out.dtype)
    out = out if is_one(alpha) else out * cast(alpha, out.dtype)
    if beta == 0:  # torch ignores input (even NaN) when beta is 0
        out = jnp.broadcast_to(out, jnp.broadcast_shapes(input.shape, out.shape))
    else:
        out = (input if is_one(beta) else input * cast(beta, input.dtype)) + out
    return out.astype(dtype)


@register_lowering(aten.addmm.default)
def addmm(self, mat1, mat2, *, beta=1, alpha=1):
    return addmm_transposed(self, mat1, mat2, False, False, beta, alpha)


def addmm_transposed(input, a, b, trans_a: bool, trans_b: bool, beta=1, alpha=1):
    """``aten.addmm`` with ``op(a)`` and ``op(b)``, as :func:`mm_transposed` takes them."""
    _same_dtype("addmm", input, a)
    return _scaled_sum(input, mm_transposed(a, b, trans_a, trans_b, accumulated=True), beta, alpha)


@register_lowering(aten.baddbmm.default)
def baddbmm(self, batch1, batch2, *, beta=1, alpha=1):
    _check_rank("baddbmm", batch1, 3), _check_rank("baddbmm", batch2, 3)
    return _beta_alpha("baddbmm", self, batch1, batch2, bmm, beta, alpha)


@register_lowering(aten.addmv.default)
def addmv(self, mat, vec, *, beta=1, alpha=1):
    _check_rank("addmv", mat, 2), _check_rank("addmv", vec, 1)
    return _beta_alpha("addmv", self, mat, vec, mv, beta, alpha)


@register_lowering(aten._trilinear.default)
def trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """``(i1.unsqueeze(expand1) * i2.unsqueeze(expand2) * i3.unsqueeze(expand3)).sum(sumdim)`` (what
    nn.Bilinear runs) as one contraction: each input's dims are the product's dims it was not
    expanded at."""
    total = i1.ndim + len(expand1)
    letters = [chr(ord("a") + d) for d in range(total)]

    def spec(expand):
        return "".join(letters[d] for d in range(total) if d not in expand)

    specs = [spec(expand1), spec(expand2), spec(expand3)]
    kept = [d for d in range(total) if d not in sumdim]
    present = [d for d in kept if any(letters[d] in s for s in specs)]
    out = jnp.einsum(f"{','.join(specs)}->{''.join(letters[d] for d in present)}", i1, i2, i3)
    return jnp.expand_dims(out, [i for i, d in enumerate(kept) if d not in present])
