"""One DCNv2 low-rank cross layer fused into a Pallas kernel (TorchRec ``LowRankCrossNet``'s layer).

``x_next = x0 * (W (V x) + b) + x`` with ``V [r, d]``, ``W [d, r]``, ``b [d]``, for ``x0, x [B, d]``.
Forward and backward each read every operand once per 8-sample block; the backward kernel
accumulates the weight gradients over the blocks (a sequential grid axis).
"""

from __future__ import annotations

import torch
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_tpu.ops.pallas.op import jax_op
from torch_tpu.ops.pallas.platform import batch_block, check_float_operands, kernel_call, traceable
from torch_tpu.runtime._jax import jax, jnp

_F32 = jnp.float32


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), preferred_element_type=_F32)


def _forward_kernel(x0_ref, x_ref, v_ref, w_ref, b_ref, out_ref):
    x = x_ref[...].astype(_F32)
    projected = _dot(_dot(x, v_ref[...].astype(_F32), (1, 1)), w_ref[...].astype(_F32), (1, 1))
    out_ref[...] = (x0_ref[...].astype(_F32) * (projected + b_ref[...].astype(_F32)) + x).astype(out_ref.dtype)


def _backward_kernel(x0_ref, x_ref, v_ref, w_ref, b_ref, g_ref, dx0_ref, dx_ref, dv_ref, dw_ref, db_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
        dv_ref[...] = jnp.zeros_like(dv_ref)
        dw_ref[...] = jnp.zeros_like(dw_ref)
        db_ref[...] = jnp.zeros_like(db_ref)

    x0, x, g = (r[...].astype(_F32) for r in (x0_ref, x_ref, g_ref))
    v, w = v_ref[...].astype(_F32), w_ref[...].astype(_F32)
    low = _dot(x, v, (1, 1))                       # [b, r]
    projected = _dot(low, w, (1, 1)) + b_ref[...].astype(_F32)
    d_projected = g * x0                           # [b, d]
    d_low = _dot(d_projected, w, (1, 0))           # [b, r]
    dx0_ref[...] = (g * projected).astype(dx0_ref.dtype)
    dx_ref[...] = (g + _dot(d_low, v, (1, 0))).astype(dx_ref.dtype)
    dw_ref[...] += _dot(d_projected, low, (0, 0)).astype(dw_ref.dtype)   # [d, r]
    dv_ref[...] += _dot(d_low, x, (0, 0)).astype(dv_ref.dtype)           # [r, d]
    db_ref[...] += jnp.sum(d_projected, axis=0, keepdims=True).astype(db_ref.dtype)


def low_rank_cross_reference(x0: jax.Array, x: jax.Array, v: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    """The same layer as plain XLA operations."""
    return x0 * ((x @ v.T) @ w.T + b) + x


def _specs(batch: int, dim: int, rank: int):
    block = batch_block(batch)
    rows = pl.BlockSpec((block, dim), lambda i: (i, 0))
    whole = [pl.BlockSpec((rank, dim), lambda i: (0, 0)), pl.BlockSpec((dim, rank), lambda i: (0, 0)),
             pl.BlockSpec((1, dim), lambda i: (0, 0))]
    return block, rows, whole


def _forward(x0: torch.Tensor, x: torch.Tensor, v: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    (batch, dim), rank = x.shape, v.shape[0]
    block, rows, whole = _specs(batch, dim, rank)
    return kernel_call(
        _forward_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(batch // block,),
        in_specs=[rows, rows, *whole],
        out_specs=rows,
    )(x0, x, v, w, b.reshape(1, dim))


def _backward(x0, x, v, w, b, grad):
    (batch, dim), rank = x.shape, v.shape[0]
    block, rows, whole = _specs(batch, dim, rank)
    dx0, dx, dv, dw, db = kernel_call(
        _backward_kernel,
        out_shape=(jax.ShapeDtypeStruct(x0.shape, x0.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype),
                   jax.ShapeDtypeStruct(v.shape, _F32), jax.ShapeDtypeStruct(w.shape, _F32),
                   jax.ShapeDtypeStruct((1, dim), _F32)),
        grid=(batch // block,),
        in_specs=[rows, rows, *whole, rows],
        out_specs=(rows, rows, *whole),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
    )(x0, x, v, w, b.reshape(1, dim), grad)
    return dx0, dx, dv.astype(v.dtype), dw.astype(w.dtype), db.reshape(dim).astype(b.dtype)


_low_rank_cross = jax_op("torch_tpu_pallas::low_rank_cross", _forward, backward=_backward)


@traceable
def low_rank_cross(x0: torch.Tensor, x: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
                   b: torch.Tensor) -> torch.Tensor:
    """One fused DCNv2 low-rank cross layer ``x0 * (W (V x) + b) + x`` (``V [r, d]``, ``W [d, r]``,
    ``b [d]``; ``x0, x [B, d]``), a Pallas kernel on tpu tensors; differentiable in every input."""
    if x0.shape != x.shape or x.dim() != 2:
        raise ValueError(f"low_rank_cross: x0 {list(x0.shape)} and x {list(x.shape)} must both be [batch, dim]")
    dim, rank = x.shape[1], v.shape[0]
    if tuple(v.shape) != (rank, dim) or tuple(w.shape) != (dim, rank) or tuple(b.shape) != (dim,):
        raise ValueError(
            f"low_rank_cross: for dim {dim} expected V [r, {dim}], W [{dim}, r], b [{dim}]; got "
            f"V {list(v.shape)}, W {list(w.shape)}, b {list(b.shape)}"
        )
    check_float_operands("low_rank_cross", x0=x0, x=x, v=v, w=w, b=b)
    return _low_rank_cross(x0, x, v, w, b)
