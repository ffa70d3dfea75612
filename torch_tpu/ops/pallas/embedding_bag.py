"""Pooled embedding bags over CSR input as a Pallas kernel (forward and backward).

Input is the layout SparseCore host preprocessing produces: ``ids[n]`` with ``row_pointers[b]``
.. ``row_pointers[b + 1]`` the ids of bag ``b`` and ``gains[n]`` each id's weight, the combiner
already folded in on the host (sum: w, mean: w / sum w, sqrtn: w / sqrt(sum w^2);
:func:`combiner_gains`), so the kernel computes only ``out[b] = sum_j gains[j] * table[ids[j]]``.

The table stays in HBM (``memory_space=ANY``); each program gathers the rows of 8 bags by DMA.
Backward: ``d table[ids[j]] += gains[j] * d out[b]`` applied id by id (duplicate ids accumulate)
and ``d gains[j] = <table[ids[j]], d out[b]>``.
"""

from __future__ import annotations

import torch
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_tpu.ops.pallas.op import jax_op
from torch_tpu.ops.pallas.platform import check_float_operands, kernel_call, traceable
from torch_tpu.runtime._jax import jax, jnp

_BAGS_PER_PROGRAM = 8
_SMEM = pl.BlockSpec(memory_space=pltpu.SMEM)
_HBM = pl.BlockSpec(memory_space=pl.ANY)


def _padded_pointers(row_pointers: jax.Array) -> tuple[jax.Array, int]:
    bags = row_pointers.shape[0] - 1
    padded = -(-bags // _BAGS_PER_PROGRAM) * _BAGS_PER_PROGRAM
    tail = jnp.broadcast_to(row_pointers[-1:], (padded - bags,))
    return jnp.concatenate([row_pointers, tail]).astype(jnp.int32), padded


def _forward_kernel(ptr_ref, ids_ref, gains_ref, table_hbm, out_ref, row_vmem):
    first_bag = pl.program_id(0) * _BAGS_PER_PROGRAM
    dim = out_ref.shape[1]
    for r in range(_BAGS_PER_PROGRAM):
        bag = first_bag + r

        def add_row(j, acc):
            pltpu.sync_copy(table_hbm.at[pl.ds(ids_ref[j], 1)], row_vmem)
            return acc + gains_ref[j] * row_vmem[...].astype(jnp.float32)

        acc = lax.fori_loop(ptr_ref[bag], ptr_ref[bag + 1], add_row, jnp.zeros((1, dim), jnp.float32))
        out_ref[pl.ds(r, 1), :] = acc.astype(out_ref.dtype)


def _backward_kernel(ptr_ref, ids_ref, gains_ref, grad_ref, table_hbm, zeros_hbm,
                     dtable_hbm, dgains_ref, row_vmem, acc_vmem):
    del zeros_hbm  # aliased to dtable_hbm: the accumulator starts from zeros
    bags = grad_ref.shape[0]

    def bag_body(bag, carry):
        grad_row = grad_ref[pl.ds(bag, 1), :].astype(jnp.float32)

        def id_body(j, carry):
            pltpu.sync_copy(table_hbm.at[pl.ds(ids_ref[j], 1)], row_vmem)
            dgains_ref[j] = jnp.sum(row_vmem[...].astype(jnp.float32) * grad_row)
            pltpu.sync_copy(dtable_hbm.at[pl.ds(ids_ref[j], 1)], acc_vmem)
            acc_vmem[...] = acc_vmem[...] + (gains_ref[j] * grad_row).astype(acc_vmem.dtype)
            pltpu.sync_copy(acc_vmem, dtable_hbm.at[pl.ds(ids_ref[j], 1)])
            return carry

        return lax.fori_loop(ptr_ref[bag], ptr_ref[bag + 1], id_body, carry)

    lax.fori_loop(0, bags, bag_body, 0)


def embedding_bag_csr_reference(table: jax.Array, ids: jax.Array, row_pointers: jax.Array,
                                gains: jax.Array) -> jax.Array:
    """The same pooling as plain XLA operations (gather + segment sum): the kernel's reference."""
    bags = row_pointers.shape[0] - 1
    segment = jnp.searchsorted(row_pointers, jnp.arange(ids.shape[0]), side="right") - 1
    rows = table[ids].astype(jnp.float32) * gains[:, None].astype(jnp.float32)
    return jax.ops.segment_sum(rows, segment, num_segments=bags).astype(table.dtype)


def _forward(table: torch.Tensor, ids: torch.Tensor, row_pointers: torch.Tensor,
             gains: torch.Tensor) -> torch.Tensor:
    bags = row_pointers.shape[0] - 1
    ptr, padded = _padded_pointers(row_pointers)
    out = kernel_call(
        _forward_kernel,
        out_shape=jax.ShapeDtypeStruct((padded, table.shape[1]), table.dtype),
        grid=(padded // _BAGS_PER_PROGRAM,),
        in_specs=[_SMEM, _SMEM, _SMEM, _HBM],
        out_specs=pl.BlockSpec((_BAGS_PER_PROGRAM, table.shape[1]), lambda i: (i, 0)),
        scratch_shapes=[pltpu.VMEM((1, table.shape[1]), table.dtype)],
    )(ptr, ids.astype(jnp.int32), gains.astype(jnp.float32), table)
    return out[:bags]


def _backward(table, ids, row_pointers, gains, grad):
    dtable, dgains = kernel_call(
        _backward_kernel,
        out_shape=(jax.ShapeDtypeStruct(table.shape, table.dtype),
                   jax.ShapeDtypeStruct(gains.shape, jnp.float32)),
        grid=(1,),
        in_specs=[_SMEM, _SMEM, _SMEM, pl.BlockSpec(grad.shape, lambda i: (0, 0)), _HBM, _HBM],
        out_specs=(_HBM, _SMEM),
        scratch_shapes=[pltpu.VMEM((1, table.shape[1]), table.dtype),
                        pltpu.VMEM((1, table.shape[1]), table.dtype)],
        input_output_aliases={5: 0},
    )(row_pointers.astype(jnp.int32), ids.astype(jnp.int32), gains.astype(jnp.float32), grad, table,
      jnp.zeros_like(table))
    return dtable, dgains.astype(gains.dtype)


_embedding_bag_csr = jax_op("torch_tpu_pallas::embedding_bag_csr", _forward, backward=_backward,
                            differentiable=("table", "gains"))


@traceable
def embedding_bag_csr(table: torch.Tensor, ids: torch.Tensor, row_pointers: torch.Tensor,
                      gains: torch.Tensor) -> torch.Tensor:
    """Pooled bags ``out[b] = sum gains[j] * table[ids[j]]`` over CSR input, as a Pallas kernel.

    ``table [V, D]``, ``ids [N]`` (int), ``row_pointers [B + 1]`` (int, non-decreasing, 0 .. N),
    ``gains [N]`` (float, the combiner folded in: :func:`combiner_gains`) -> ``[B, D]``, on tpu
    tensors. Differentiable in ``table`` and ``gains``."""
    if table.dim() != 2 or ids.dim() != 1 or row_pointers.dim() != 1 or gains.shape != ids.shape:
        raise ValueError(
            f"embedding_bag_csr expects table [V, D], ids [N], row_pointers [B + 1], gains [N]; got table "
            f"{list(table.shape)}, ids {list(ids.shape)}, row_pointers {list(row_pointers.shape)}, "
            f"gains {list(gains.shape)}"
        )
    for name, t in (("ids", ids), ("row_pointers", row_pointers)):
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"embedding_bag_csr: {name} is {t.dtype}; expected int32 or int64")
    check_float_operands("embedding_bag_csr", table=table, gains=gains)
    return _embedding_bag_csr(table, ids, row_pointers, gains)


def combiner_gains(row_pointers: torch.Tensor, weights: torch.Tensor | None, combiner: str,
                   num_ids: int) -> torch.Tensor:
    """Per-id gains with the combiner folded in, as SparseCore host preprocessing computes them:
    sum -> w, mean -> w / sum(w), sqrtn -> w / sqrt(sum(w^2)) per bag (w = 1 without weights)."""
    if combiner not in ("sum", "mean", "sqrtn"):
        raise ValueError(f"combiner {combiner!r} is not one of 'sum', 'mean', 'sqrtn'")
    lengths = (row_pointers[1:] - row_pointers[:-1]).to(torch.int64)
    w = torch.ones(num_ids, device=row_pointers.device) if weights is None else weights.to(torch.float32)
    if combiner == "sum":
        return w
    bag_of_id = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths,
                                        output_size=num_ids)
    per_bag = torch.zeros(lengths.numel(), device=w.device).index_add_(0, bag_of_id, w if combiner == "mean" else w * w)
    norm = per_bag if combiner == "mean" else per_bag.sqrt()
    return w / norm[bag_of_id]
