"""``nn.EmbeddingBag`` lowerings: ``_embedding_bag`` forward (sum / mean / max) and its backwards.

Bags are segments of the flat ``indices``: entry ``i`` belongs to bag ``offset2bag[i]``; the last
bag runs to the end of ``indices``, or to the final offset with ``include_last_offset``. Entries
equal to ``padding_idx`` contribute nothing and are not counted. Empty bags give zeros. The
auxiliary outputs have the shapes PyTorch's meta kernel gives a non-CPU device
(what ``torch.compile`` graphs are traced with): ``offset2bag`` ``[len(indices)]``, the bag of
each entry; ``bag_size`` ``[len(offsets)]``, each bag's non-padding entries in every mode (0 past
the last bag with ``include_last_offset``); ``max_indices`` ``[bags, dim]`` in max mode, the weight
row of each (bag, dim) maximum (0 for empty bags), else empty. The backwards also accept CPU's
layout (an empty ``offset2bag`` on its sum fast path, ``bag_size`` of ``[bags]``).
"""

from __future__ import annotations

import torch

from torch_tpu.ops.lowerings._common import upcast
from torch_tpu.ops.registry import register_lowering
from torch_tpu.runtime._jax import jax, jnp

aten = torch.ops.aten
SUM, MEAN, MAX = 0, 1, 2


def _offset2bag(indices, offsets, bags):
    """The bag of each entry of ``indices``: the last of the first ``bags`` offsets at or before it."""
    starts = offsets[:bags]
    positions = jnp.arange(indices.shape[0], dtype=starts.dtype)
    bag = jnp.searchsorted(starts, positions, side="right") - 1
    return jnp.clip(bag, 0, max(bags - 1, 0)).astype(jnp.int64)


def _keep(indices, padding_idx):
    return indices != padding_idx if padding_idx is not None and padding_idx >= 0 else jnp.ones(indices.shape, bool)


def _counts(bag, keep, bags):
    return jax.ops.segment_sum(keep.astype(jnp.int64), bag, num_segments=bags)


def _check_per_sample_weights(weight, indices, per_sample_weights, mode):
    """CPU's checks; the ValueError becomes the exception CPU torch raises for the call (dispatch)."""
    if mode != SUM:
        raise ValueError("embedding_bag: per_sample_weights is only supported for mode='sum'")
    if per_sample_weights.ndim != 1 or per_sample_weights.size != indices.size:
        raise ValueError(f"embedding_bag: per_sample_weights of shape {per_sample_weights.shape} must be 1-D with "
                         f"one weight per index ({indices.size})")
    if per_sample_weights.dtype != weight.dtype:
        raise ValueError(f"embedding_bag: per_sample_weights ({per_sample_weights.dtype}) must have the "
                         f"weight's dtype ({weight.dtype})")


@register_lowering(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=SUM, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    if per_sample_weights is not None:
        _check_per_sample_weights(weight, indices, per_sample_weights, mode)
    bags = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
    bag = _offset2bag(indices, offsets, bags)
    keep = _keep(indices, padding_idx)
    summed = keep
    if include_last_offset:  # the final offset ends the last bag's sum; CPU's mean divisor and max do not stop there
        summed = keep & (jnp.arange(indices.shape[0]) < offsets[bags])
    rows = upcast(jnp.take(weight, indices, axis=0))
    if per_sample_weights is not None:
        rows = rows * upcast(per_sample_weights)[:, None]
    counts = _counts(bag, keep, bags)
    bag_size = jnp.pad(counts, (0, offsets.shape[0] - bags))
    if mode == MAX:
        filled = (counts > 0)[:, None]
        masked = jnp.where(keep[:, None], rows, -jnp.inf)
        top = jax.ops.segment_max(masked, bag, num_segments=bags)
        out = jnp.where(filled, top, 0)
        # the first entry reaching the maximum, per (bag, dim), as on CPU
        hit = keep[:, None] & (masked == top[bag])
        position = jnp.where(hit, jnp.arange(indices.shape[0])[:, None], indices.shape[0])
        first = jax.ops.segment_min(position, bag, num_segments=bags)
        if indices.shape[0] == 0:  # every bag empty: nothing to gather from
            max_indices = jnp.zeros(top.shape, jnp.int64)
        else:
            max_indices = jnp.where(filled, indices.astype(jnp.int64)[jnp.clip(first, 0, indices.shape[0] - 1)], 0)
        return out.astype(weight.dtype), bag, bag_size, max_indices
    total = jax.ops.segment_sum(jnp.where(summed[:, None], rows, 0), bag, num_segments=bags)
    if mode == MEAN:
        total = total / jnp.maximum(counts, 1)[:, None]
    return total.astype(weight.dtype), bag, bag_size, jnp.zeros((0,), jnp.int64)


def _scaled_by_freq(grad_rows, indices, num_weights):
    freq = jnp.zeros((num_weights,), grad_rows.dtype).at[indices].add(1)
    return grad_rows / freq[indices][:, None]


@register_lowering(aten._embedding_bag_dense_backward.default)
def embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                 scale_grad_by_freq, mode, per_sample_weights, padding_idx=-1):
    g = upcast(grad)
    keep = _keep(indices, padding_idx)
    if mode == MAX:
        filled = (bag_size[: g.shape[0]] > 0)[:, None]
        dims = jnp.broadcast_to(jnp.arange(g.shape[1]), maximum_indices.shape)
        rows = jnp.where(filled, maximum_indices, num_weights)  # empty bags scatter out of bounds: dropped
        out = jnp.zeros((num_weights, g.shape[1]), g.dtype).at[rows, dims].add(jnp.where(filled, g, 0), mode="drop")
        return out.astype(grad.dtype)
    grad_rows = g[offset2bag]
    if mode == MEAN:
        grad_rows = grad_rows / jnp.maximum(bag_size[offset2bag], 1)[:, None]
    if per_sample_weights is not None:
        grad_rows = grad_rows * upcast(per_sample_weights)[:, None]
    if scale_grad_by_freq:
        grad_rows = _scaled_by_freq(grad_rows, indices, num_weights)
    grad_rows = jnp.where(keep[:, None], grad_rows, 0)
    return jnp.zeros((num_weights, g.shape[1]), g.dtype).at[indices].add(grad_rows).astype(grad.dtype)


@register_lowering(aten._embedding_bag_backward.default)
def embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                           scale_grad_by_freq, mode, sparse, per_sample_weights, padding_idx=-1):
    if sparse:
        # eager dispatch runs ATen's sparse backward instead (torch_tpu.eager.sparse);
        # compiled programs hold dense arrays
        raise ValueError("embedding_bag: sparse=True gradients are not supported in compiled programs; "
                         "use sparse=False")
    if offset2bag.shape[0] != indices.shape[0]:  # CPU's sum fast path leaves it empty
        offset2bag = _offset2bag(indices, offsets, grad.shape[0])
    return embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                        scale_grad_by_freq, mode, per_sample_weights, padding_idx)


@register_lowering(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    if mode != SUM:
        raise ValueError("embedding_bag: per_sample_weights gradients exist only for mode='sum'")
    if offset2bag.shape[0] != indices.shape[0]:
        offset2bag = _offset2bag(indices, offsets, grad.shape[0])
    dots = jnp.sum(upcast(grad)[offset2bag] * upcast(jnp.take(weight, indices, axis=0)), axis=1)
    return jnp.where(_keep(indices, padding_idx), dots, 0).astype(grad.dtype)
