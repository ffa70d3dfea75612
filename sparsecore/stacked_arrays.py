"""A stack's table or slot as one JAX array, filled and read one logical table at a time: how
every backend holding stacks in JAX arrays (``xla``, ``tpu``, and the ``ops`` backend's tpu
tensors, which share their arrays) loads and reads them.

:func:`stacked_array` builds a stack's array from per-table host tensors without ever holding a
full-stack host copy: the array starts as zeros on the device and each table's rows go in, in
chunks of about :data:`CHUNK_BYTES`, by a program that donates the array (XLA updates it in place),
and the heap's freed pages go back to the system after each chunk and table: on XLA:CPU glibc
serves large blocks from its heap and does not reuse a freed device buffer for the next one of the
same size, so each chunk's and table's freed copies stayed resident (0.5-0.7x the tables at 10-29M rows).
:func:`unstack_table` reads one table's rows back to the host (a gather of that table only). So
loading and saving hold at most one table (plus a chunk) beside the live stacks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import torch

from sparsecore.stacking import StackedTable
from xla_cache import host_heap

CHUNK_BYTES = 1 << 26  # host rows per transfer: 64 MiB (a power of two of rows: few program shapes)
# an eviction's row count is padded to this times a power of 4: each new count compiles a program
# (50-80 ms on XLA:CPU, per stack shape, for the table and each slot), and with powers of two from 1 a job's first
# evictions compiled ~24 of them (1.1 s an eviction at the anchor shape); the padded rows cost nothing
RESET_ROWS_FLOOR = 4096


def chunk_rows(width: int) -> int:
    """Rows of ``width`` fp32 values per chunk: a power of two, about :data:`CHUNK_BYTES`."""
    return 1 << max(0, (CHUNK_BYTES // (4 * max(width, 1))).bit_length() - 1)


@lru_cache(maxsize=None)
def _put_rows(row_slot: bool) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """``(stacked, rows, values) -> stacked`` with ``values`` written at ``rows`` (rows past the
    end: dropped), in place: the stacked array is donated."""
    def put(stacked: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
        if row_slot:
            return stacked.at[rows].set(values, mode="drop")
        return stacked.at[rows, :values.shape[1]].set(values, mode="drop")

    return jax.jit(put, donate_argnums=0)


def reset_table_rows(stack: StackedTable, table: str, arrays: Sequence[jax.Array], rows: np.ndarray,
                     weights: np.ndarray, slot_values: Sequence[float]) -> list[jax.Array]:
    """``stack``'s arrays (its table, then slots; each donated) with ``table``'s logical ``rows``
    set: the table's to ``weights`` ([len(rows), table dim]), each slot's to its value in
    ``slot_values`` (a managed-collision eviction). Written in place, the row count padded to
    :data:`RESET_ROWS_FLOOR` times a power of 4 with rows past the end (dropped), so a few programs
    serve every eviction."""
    count = RESET_ROWS_FLOOR
    while count < rows.size:
        count *= 4
    at = np.full(count, stack.vocab_size, dtype=np.int64)
    at[:rows.size] = stack.physical_rows(table, rows)
    dim = stack.table(table).dim
    values = np.zeros((count, dim), dtype=np.float32)
    values[:rows.size] = weights
    at_device = jnp.asarray(at)
    out = [_set_rows(arrays[0], at_device, jnp.asarray(values), dim)]
    for array, value in zip(arrays[1:], slot_values, strict=True):
        out.append(_set_rows(array, at_device, jnp.asarray(value, dtype=array.dtype), dim))
    return out


@partial(jax.jit, static_argnums=3, donate_argnums=0)
def _set_rows(array: jax.Array, at: jax.Array, values: jax.Array, dim: int) -> jax.Array:
    """``array``'s rows ``at`` (their first ``dim`` columns; a 1-D row slot: one value per row) set
    to ``values``, in place: the stack is donated (eager ``.at[].set`` copied the whole stack per
    table, seconds per eviction at 26 tables)."""
    where = array.at[at] if array.ndim == 1 else array.at[at, :dim]
    return where.set(values, mode="drop")


@jax.jit
def _take_rows(stacked: jax.Array, rows: jax.Array) -> jax.Array:
    return jnp.take(stacked, rows, axis=0)


@partial(jax.jit, donate_argnums=0, keep_unused=True)  # (unused, jit would drop the argument and its donation)
def _zeroed(stacked: jax.Array) -> jax.Array:
    return jnp.zeros_like(stacked)


def stacked_array(stack: StackedTable, values_of: Callable[[str], torch.Tensor], row_slot: bool,
                  into: jax.Array | None = None) -> jax.Array:
    """``stack``'s table (``row_slot``: a row slot, one value per row) as one device array: zeros,
    then each table's ``values_of(table)`` ([vocab, dim], or [vocab]) at its rows, one table and
    chunk at a time (as ``sparsecore.stacking.stack_rows`` lays them out, padding 0). ``into``:
    the stack's current array, donated (refilled where it is: no second stack during a reload)."""
    shape = (stack.vocab_size,) if row_slot else (stack.vocab_size, stack.dim)
    if into is not None and (tuple(into.shape) != shape or into.dtype != jnp.float32):
        raise ValueError(f"stack {stack.name!r}: cannot refill a {into.dtype} array of shape {tuple(into.shape)}; "
                         f"it holds float32 {shape}")
    stacked = jnp.zeros(shape, jnp.float32) if into is None else _zeroed(into)
    put = _put_rows(row_slot)
    for placement in stack.tables:
        values = values_of(placement.table)
        expected = (placement.vocab_size,) if row_slot else (placement.vocab_size, placement.dim)
        if tuple(values.shape) != expected:
            raise ValueError(f"table {placement.table!r}: expected a tensor of shape {expected}, "
                             f"got {tuple(values.shape)}")
        host = values.detach().float().numpy()
        rows = stack.physical_rows(placement.table, np.arange(placement.vocab_size)).astype(np.int32)
        step = chunk_rows(1 if row_slot else placement.dim)
        for start in range(0, placement.vocab_size, step):
            at = np.full(step, stack.vocab_size, dtype=np.int32)  # (past the end: dropped)
            chunk = np.zeros((step, *host.shape[1:]), dtype=np.float32)
            n = min(step, placement.vocab_size - start)
            at[:n], chunk[:n] = rows[start:start + n], host[start:start + n]
            # (waited for: queued programs would each hold their chunk's copy)
            stacked = put(stacked, jnp.asarray(at), jnp.asarray(chunk)).block_until_ready()
            del at, chunk
            host_heap.release()
        del values, host
        host_heap.release()
    return stacked


def unstack_table(stack: StackedTable, stacked: jax.Array, table: str) -> torch.Tensor:
    """``table``'s rows of ``stack``'s array ``stacked`` (its table or a slot), cut to the table's
    vocab and dim: a new host tensor; only that table's rows are gathered."""
    placement = stack.table(table)
    host_heap.release()  # what the last table's read left freed (its gathered and host copies)
    rows = stack.physical_rows(table, np.arange(placement.vocab_size)).astype(np.int32)
    values = torch.from_numpy(np.array(_take_rows(stacked, jnp.asarray(rows)), copy=True))
    host_heap.release()  # the gathered device copy, freed
    return values if values.dim() == 1 or placement.dim == stack.dim else values[:, :placement.dim].clone()
