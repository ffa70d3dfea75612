"""DLRM dot interaction as a Pallas kernel: pairwise dots of a sample's feature vectors.

``x [B, F, D]`` (the dense arch output stacked with the F - 1 pooled embeddings, as TorchRec's
``InteractionArch`` builds it) -> ``[B, F (F - 1) / 2]``: ``<x_i, x_j>`` for ``i < j`` in row-major
upper-triangle order (``torch.triu_indices(F, F, 1)``). Each program handles 8 samples (or the
whole batch when 8 does not divide it). Backward: with ``U`` the gradient scattered into the strict
upper triangle, ``dx = (U + U^T) x``.
"""

from __future__ import annotations

import torch
from jax.experimental import pallas as pl

from torch_tpu.ops.pallas.op import jax_op
from torch_tpu.ops.pallas.platform import batch_block, check_float_operands, kernel_call, traceable
from torch_tpu.runtime._jax import jax, jnp


def _pairs(features: int) -> int:
    return features * (features - 1) // 2


def _gram(x: jax.Array) -> jax.Array:
    return jnp.einsum("bfd,bgd->bfg", x, x, preferred_element_type=jnp.float32)


def _upper(z: jax.Array) -> jax.Array:
    features = z.shape[1]
    return jnp.concatenate([z[:, i, i + 1:] for i in range(features - 1)], axis=1)


def _scatter_upper(g: jax.Array, features: int) -> jax.Array:
    """[b, pairs] -> [b, F, F] with the pairs in the strict upper triangle, zeros elsewhere."""
    rows, start = [], 0
    for i in range(features):
        width = features - 1 - i
        pieces = [jnp.zeros((g.shape[0], i + 1), g.dtype)]
        if width:
            pieces.append(g[:, start:start + width])
        rows.append(jnp.concatenate(pieces, axis=1)[:, None, :])
        start += width
    return jnp.concatenate(rows, axis=1)


def _forward_kernel(x_ref, out_ref):
    out_ref[...] = _upper(_gram(x_ref[...])).astype(out_ref.dtype)


def _backward_kernel(x_ref, g_ref, dx_ref):
    x = x_ref[...].astype(jnp.float32)
    upper = _scatter_upper(g_ref[...].astype(jnp.float32), x.shape[1])
    sym = upper + jnp.swapaxes(upper, 1, 2)
    dx_ref[...] = jnp.einsum("bfg,bgd->bfd", sym, x).astype(dx_ref.dtype)


def dot_interaction_reference(x: jax.Array) -> jax.Array:
    """The same interaction as plain XLA operations (batched matmul + upper-triangle gather)."""
    rows, cols = jnp.triu_indices(x.shape[1], 1)
    return _gram(x)[:, rows, cols].astype(x.dtype)


def _forward(x: torch.Tensor) -> torch.Tensor:
    batch, features, dim = x.shape
    block = batch_block(batch)
    return kernel_call(
        _forward_kernel,
        out_shape=jax.ShapeDtypeStruct((batch, _pairs(features)), x.dtype),
        grid=(batch // block,),
        in_specs=[pl.BlockSpec((block, features, dim), lambda i: (i, 0, 0))],
        out_specs=pl.BlockSpec((block, _pairs(features)), lambda i: (i, 0)),
    )(x)


def _backward(x, grad):
    batch, features, dim = x.shape
    block = batch_block(batch)
    return kernel_call(
        _backward_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(batch // block,),
        in_specs=[pl.BlockSpec((block, features, dim), lambda i: (i, 0, 0)),
                  pl.BlockSpec((block, _pairs(features)), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((block, features, dim), lambda i: (i, 0, 0)),
    )(x, grad)


_dot_interaction = jax_op("torch_tpu_pallas::dot_interaction", _forward, backward=_backward)


@traceable
def dot_interaction(x: torch.Tensor) -> torch.Tensor:
    """Pairwise dots ``<x_i, x_j>`` (``i < j``) of each sample's ``F`` vectors: ``[B, F, D]`` ->
    ``[B, F (F - 1) / 2]``, in ``torch.triu_indices(F, F, 1)`` order; a Pallas kernel on tpu tensors."""
    if x.dim() != 3 or x.shape[1] < 2:
        raise ValueError(f"dot_interaction expects [batch, features >= 2, dim], got {list(x.shape)}")
    check_float_operands("dot_interaction", x=x)
    return _dot_interaction(x)
