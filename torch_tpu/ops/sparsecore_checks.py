"""Input checks of the ``tpu::sparse_dense_matmul*`` ops: each bad input raises ONE ValueError that
names the argument, the bad value and its limit.

* :func:`check_layout`: dtypes (integer buffers, floating gains, table, slots and gradient), ranks,
  equal buffer lengths, the row-pointer size, the divisions among SparseCores, the shapes of the
  activation gradient and the slots. Metadata only: the fake kernels run it, so every
  ``torch.compile`` / ``train_step`` trace checks it too.
* :func:`check_values`: the CSR buffers' values on the host. Per source SparseCore region, the N
  used row pointers (partition ends) lie in ``[0, region]`` and do not decrease; in every
  partition's entries ``[round_up(end[p-1], 8), end[p])`` each embedding id lies in ``[0, rows
  per partition)`` and each sample id in ``[0, device_batch_size / N)``, and no partition holds
  more than ``max_ids_per_partition`` entries (a SparseCore's static buffer). Padding positions are
  not read (jax-tpu-embedding fills them with id 2^31-1 and gain NaN). A ``touched_rows`` given
  must be ``touched_rows_ahead`` of the same buffers, cut to no fewer unique rows than they touch
  (:func:`check_touched`: recomputed on the host, one sort).

Policy. Eager calls check both, in every eager mode: the CPU kernels, and eager dispatch on tpu
tensors (one device-to-host read of the three integer buffers per call). Inside compiled programs
values follow TorchTPU's modes: the ``debug`` mode checks the concrete CSR inputs of a compiled
graph before it runs (``torch_tpu.compile.program.graph``); in ``strict`` and ``defer_and_fuse``, as on a
TPU, out-of-range values give undefined results (the XLA formulation reads another row, or
drops the entry). A CSR buffer computed inside the graph is never value-checked.

The engine's own host preprocessing builds valid buffers by construction: its calls run inside
:func:`preprocessed`, which skips the value checks (not the layout checks) for the calls of the
current thread and context.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from torch_tpu.runtime._jax import jnp
from tpu_facts import ALIGNMENT, MAX_MINIBATCHES
from tpu_facts.switches import Switch

_CSR_INTS = ("row_pointers", "embedding_ids", "sample_ids")
# optimizer slots that may be row-wise ([rows]) instead of the table's [rows, dim]
_ROW_WISE = {("rowwise_adagrad", "accumulator"): "row", ("adam", "velocity"): "either"}
_PREPROCESSED = Switch("sparsecore_csr_preprocessed")


def preprocessed() -> AbstractContextManager[None]:
    """The ops called inside take CSR buffers built by ``sparsecore``'s host preprocessing (valid by
    construction): their value checks are skipped. Internal: for the engine's own calls."""
    return _PREPROCESSED.on()


def values_trusted() -> bool:
    """Whether the current call's CSR values skip their checks (inside :func:`preprocessed`)."""
    return _PREPROCESSED.is_on()


def public_name(name: str) -> str:
    """``tpu::<op>``, as users call it."""
    return f"tpu::{name}"


def _kind(dtype: Any) -> str:
    """"int", "float" or the dtype's name, for torch and numpy/JAX dtypes alike."""
    if isinstance(dtype, torch.dtype):
        if dtype.is_floating_point:
            return "float"
        return str(dtype) if dtype.is_complex or dtype == torch.bool else "int"
    if jnp.issubdtype(dtype, jnp.floating):
        return "float"
    return "int" if jnp.issubdtype(dtype, jnp.integer) else str(dtype)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


def _partitions(op: str, row_pointers_size: int, minibatches: int = 1) -> int:
    """N, the partitions (and source regions) of buffers with ``row_pointers_size`` pointers and
    ``minibatches`` minibatch slots."""
    from sparsecore import csr_math

    try:
        return csr_math.minibatch_partitions(row_pointers_size, minibatches)
    except ValueError as e:
        raise ValueError(f"{op}: {e}") from None


def check_layout(name: str, a: Mapping[str, Any], slots: tuple[str, ...] = ()) -> None:
    """Raise ValueError when the shapes or dtypes of op ``name``'s arguments ``a`` (by schema name;
    torch tensors, fake tensors or JAX arrays) do not fit together; ``slots``: the optimizer slots
    it takes after the table."""
    op = public_name(name)

    def fail(message: str) -> None:
        raise ValueError(f"{op}: {message}")

    for key in (*_CSR_INTS, "gains"):
        want = "float" if key == "gains" else "int"
        if _kind(a[key].dtype) != want:
            fail(f"{key} must be a 1-D {'floating' if want == 'float' else 'integer'} tensor, got dtype {a[key].dtype}")
        if len(a[key].shape) != 1:
            fail(f"{key} must be 1-D, got shape {list(_shape(a[key]))}")
    entries = _shape(a["embedding_ids"])[0]
    for key in ("sample_ids", "gains"):
        if _shape(a[key])[0] != entries:
            fail(f"{key} has {_shape(a[key])[0]} entries, embedding_ids {entries}: the COO buffers must have equal "
                 "lengths")
    table = a["embedding_table"]
    if _kind(table.dtype) != "float" or len(table.shape) != 2:
        fail(f"embedding_table must be a 2-D floating tensor, got dtype {table.dtype} shape {list(_shape(table))}")
    stack_rows, dim = _shape(table)
    minibatches = a.get("num_minibatches", 1)
    if not 1 <= minibatches <= MAX_MINIBATCHES:
        fail(f"num_minibatches must be in [1, {MAX_MINIBATCHES}], got {minibatches}")
    n = _partitions(op, _shape(a["row_pointers"])[0], minibatches)
    devices, device_index = a.get("devices", 1), a.get("device_index", 0)
    if minibatches > 1 and devices > 1:
        fail(f"num_minibatches {minibatches} needs one device's buffers (not supported with DTensor tables)")
    if devices < 1 or n % devices or not 0 <= device_index < devices:
        fail(f"device_index {device_index} of {devices} devices: needs 0 <= device_index < devices and devices "
             f"dividing the {n} partitions")
    local = n // devices
    batch = a["device_batch_size"]
    if entries % n:
        fail(f"embedding_ids has {entries} entries, not a multiple of the {n} SparseCore regions")
    if batch < 1 or batch % n:
        fail(f"device_batch_size {batch} must be a positive multiple of the {n} source SparseCores")
    for key in ("max_ids_per_partition", "max_unique_ids_per_partition"):
        if key in a and a[key] < 1:  # 0 would refuse every id, a negative one read as a huge unsigned limit
            fail(f"{key} must be a positive integer, got {a[key]}")
    if stack_rows % local:
        fail(f"embedding_table has {stack_rows} rows, not a multiple of its {local} partitions")
    output_rows = a.get("output_rows")
    if output_rows is not None and (_kind(output_rows.dtype) != "int" or _shape(output_rows) != (batch,)):
        fail(f"output_rows must be an integer [device_batch_size] = [{batch}] tensor, got dtype {output_rows.dtype} "
             f"shape {list(_shape(output_rows))}")
    grad, grad_rows = a.get("activations_grad"), a.get("grad_rows")
    if grad_rows is not None:
        if _kind(grad_rows.dtype) != "int" or _shape(grad_rows) != (batch,):
            fail(f"grad_rows must be an integer [device_batch_size] = [{batch}] tensor, got dtype {grad_rows.dtype} "
                 f"shape {list(_shape(grad_rows))}")
        if grad is not None and (_kind(grad.dtype) != "float" or len(_shape(grad)) != 2 or _shape(grad)[1] != dim):
            fail(f"activations_grad with grad_rows must be a floating [rows, dim = {dim}] tensor, got dtype "
                 f"{grad.dtype} shape {list(_shape(grad))}")
    elif grad is not None and (_kind(grad.dtype) != "float" or _shape(grad) != (batch, dim)):
        fail(f"activations_grad must be a floating [device_batch_size, dim] = [{batch}, {dim}] tensor, got dtype "
             f"{grad.dtype} shape {list(_shape(grad))}")
    optimizer = name.rpartition("_with_")[2]
    for slot in slots:
        value = a[slot]
        wise = _ROW_WISE.get((optimizer, slot))
        full, row = (stack_rows, dim), (stack_rows,)
        allowed = {"row": [row], "either": [full, row], None: [full]}[wise]
        if _kind(value.dtype) != "float" or _shape(value) not in allowed:
            fail(f"{slot} must be a floating tensor of shape {' or '.join(str(list(s)) for s in allowed)} (the "
                 f"table's), got dtype {value.dtype} shape {list(_shape(value))}")


def check_values(name: str, row_pointers: np.ndarray, embedding_ids: np.ndarray, sample_ids: np.ndarray,
                 stack_rows: int, device_batch_size: int, max_ids_per_partition: int, devices: int = 1,
                 minibatches: int = 1) -> None:
    """Raise ValueError at the first row pointer, embedding id or sample id of op ``name``'s host
    CSR buffers outside its range, or partition holding more than ``max_ids_per_partition``
    entries (module docstring); the layout is checked already."""
    op = public_name(name)
    if minibatches > 1:
        _check_minibatched_values(op, row_pointers, embedding_ids, sample_ids, stack_rows, device_batch_size,
                                  max_ids_per_partition, minibatches)
        return
    n = _partitions(op, row_pointers.shape[0])
    per_region = row_pointers.shape[0] // n
    region = embedding_ids.shape[0] // n
    ends = row_pointers.reshape(n, per_region)[:, :n].astype(np.int64)
    index = np.arange(n)[:, None] * per_region + np.arange(n)[None, :]  # each end's position in row_pointers
    outside = (ends < 0) | (ends > region)
    if outside.any():
        k, p = np.argwhere(outside)[0]
        raise ValueError(f"{op}: row_pointers[{index[k, p]}] = {ends[k, p]} (end of partition {p} of SparseCore {k}) "
                         f"is outside [0, {region}], the entries of one SparseCore's region")
    falls = ends[:, 1:] < ends[:, :-1]
    if falls.any():
        k, p = np.argwhere(falls)[0]
        raise ValueError(f"{op}: row_pointers[{index[k, p + 1]}] = {ends[k, p + 1]} is below row_pointers"
                         f"[{index[k, p]}] = {ends[k, p]}: partition ends must not decrease within a SparseCore's "
                         "region")
    starts = np.zeros_like(ends)
    starts[:, 1:] = -(-ends[:, :-1] // ALIGNMENT) * ALIGNMENT
    counts = np.maximum(ends - starts, 0).reshape(-1)
    over = np.flatnonzero(counts > max_ids_per_partition)
    if over.size:
        k, p = divmod(int(over[0]), n)
        raise ValueError(f"{op}: partition {p} of source SparseCore {k} holds {int(counts[over[0]])} entries "
                         f"(row_pointers[{index[k, p]}] = {ends[k, p]}), more than max_ids_per_partition "
                         f"{max_ids_per_partition}")
    first = (np.arange(n)[:, None] * region + starts).reshape(-1)
    position = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts - first, counts)
    shard_rows = stack_rows // (n // devices)
    samples = device_batch_size // n
    for key, values, limit, what in (
        ("embedding_ids", embedding_ids, shard_rows,
         f"the rows of one partition (embedding_table's {stack_rows} rows over {n // devices} partitions)"),
        ("sample_ids", sample_ids, samples,
         f"the samples of one source SparseCore (device_batch_size {device_batch_size} over {n})"),
    ):
        used = values[position].astype(np.int64)
        bad = np.flatnonzero((used < 0) | (used >= limit))
        if bad.size:
            i = int(position[bad[0]])
            k, p = divmod(int(np.searchsorted(np.cumsum(counts), bad[0], side="right")), n)
            raise ValueError(f"{op}: {key}[{i}] = {int(values[i])} (partition {p} of source SparseCore {k}) is "
                             f"outside [0, {limit}), {what}; {bad.size} entries out of range")


def _check_minibatched_values(op: str, row_pointers: np.ndarray, embedding_ids: np.ndarray, sample_ids: np.ndarray,
                              stack_rows: int, device_batch_size: int, max_ids_per_partition: int,
                              minibatches: int) -> None:
    """:func:`check_values` of one device's buffers of ``minibatches`` slots: the segments'
    (source, minibatch, partition) ends, in that order, start where the last one ended (8-aligned)
    and lie in the buffers; each holds at most ``max_ids_per_partition`` entries; their ids and
    sample ids lie in range."""
    from sparsecore import csr_math

    n = _partitions(op, row_pointers.shape[0], minibatches)
    width = row_pointers.shape[0] // (n * minibatches)
    ends = row_pointers.reshape(n * minibatches, width)[:, :n].reshape(-1).astype(np.int64)
    index = (np.arange(n * minibatches)[:, None] * width + np.arange(n)[None, :]).reshape(-1)
    starts = np.concatenate([[0], -(-ends[:-1] // ALIGNMENT) * ALIGNMENT])
    bad = np.flatnonzero((ends < starts) | (ends > embedding_ids.shape[0]))
    if bad.size:
        g = int(bad[0])
        raise ValueError(f"{op}: row_pointers[{index[g]}] = {ends[g]} (end of partition {g % n} of minibatch "
                         f"{g // n % minibatches} of SparseCore {g // (n * minibatches)}) is outside [{starts[g]}, "
                         f"{embedding_ids.shape[0]}]: from the previous end rounded up to {ALIGNMENT} to the buffers' "
                         "end")
    over = np.flatnonzero(ends - starts > max_ids_per_partition)
    if over.size:
        g = int(over[0])
        raise ValueError(f"{op}: partition {g % n} of minibatch {g // n % minibatches} of source SparseCore "
                         f"{g // (n * minibatches)} holds {ends[g] - starts[g]} entries, more than "
                         f"max_ids_per_partition {max_ids_per_partition}")
    valid = csr_math.decode(row_pointers, embedding_ids, sample_ids, np.zeros(embedding_ids.shape, np.float32),
                            stack_rows, device_batch_size, xp=np, minibatches=minibatches)[3]
    for key, values, limit in (("embedding_ids", embedding_ids, stack_rows // n),
                               ("sample_ids", sample_ids, device_batch_size // n)):
        out = np.flatnonzero(valid & ((values < 0) | (values >= limit)))
        if out.size:
            i = int(out[0])
            raise ValueError(f"{op}: {key}[{i}] = {int(values[i])} is outside [0, {limit}) (minibatched buffers of "
                             f"{n} SparseCores); {out.size} entries out of range")


def check_output_rows(name: str, output_rows: np.ndarray) -> None:
    """Raise ValueError unless ``output_rows`` is a permutation of its [device_batch_size] positions."""
    counts = np.bincount(output_rows[(output_rows >= 0) & (output_rows < output_rows.size)].astype(np.int64),
                         minlength=output_rows.size)
    missing = np.flatnonzero(counts != 1)
    if missing.size:
        raise ValueError(f"{public_name(name)}: output_rows must be a permutation of 0..{output_rows.size - 1} "
                         f"(one output row per activation row); row {int(missing[0])} occurs "
                         f"{int(counts[missing[0]])} times")


def check_grad_rows(name: str, grad_rows: np.ndarray, grad_rows_available: int) -> None:
    """Raise ValueError unless every ``grad_rows`` value is a row of ``activations_grad`` (which has
    ``grad_rows_available`` rows)."""
    bad = np.flatnonzero((grad_rows < 0) | (grad_rows >= grad_rows_available))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{public_name(name)}: grad_rows[{i}] = {int(grad_rows[i])} is outside [0, "
                         f"{grad_rows_available}), the rows of activations_grad; {bad.size} out of range")


def check_touched(name: str, touched: np.ndarray, csr: tuple[np.ndarray, ...], stack_rows: int,
                  device_batch_size: int, devices: int = 1, device_index: int = 0, minibatches: int = 1) -> None:
    """Raise ValueError unless ``touched`` is ``csr_math.touched_rows`` of the host CSR buffers ``csr``
    (row pointers, embedding ids, sample ids, gains), cut to at least the unique rows they touch."""
    from sparsecore import csr_math

    op = public_name(name)
    entries = csr[1].shape[0]
    try:
        csr_math.split_touched(touched, entries)
    except ValueError as e:
        raise ValueError(f"{op}: {e}") from None
    phys = csr_math.decode(*csr, stack_rows, device_batch_size, devices, device_index, xp=np,
                           minibatches=minibatches)[0]
    expected = csr_math.touched_rows(phys, stack_rows, xp=np)
    used = int(expected[2 * entries - 1]) + 1
    if touched.shape[0] - 2 * entries < used:
        raise ValueError(f"{op}: touched_rows keeps {touched.shape[0] - 2 * entries} unique rows; these buffers "
                         f"touch {used} (touched_rows_ahead() of the same buffers)")
    differs = np.flatnonzero(touched != expected[:touched.shape[0]])
    if differs.size:
        i = int(differs[0])
        raise ValueError(f"{op}: touched_rows[{i}] = {int(touched[i])}, but touched_rows_ahead() of these buffers "
                         f"has {int(expected[i])} there: touched_rows must be computed from the same buffers")
