"""``xla`` backend: the SparseCore lookup semantics in pure JAX, jit-compiled.

It consumes exactly the CSR buffers the SparseCores get (``sparsecore.preprocess``) and runs on
the default JAX device: the program a TPU's TensorCore would run, and the reference for the
``tpu`` backend. Forward: activation[sample] = sum of gain * row over the sample's entries.
Backward: per touched row, g = sum(gain * d_activation[sample]) over all its entries, then one
fused optimizer update of that row and its slots; other rows are untouched.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import torch

from sparsecore.backends.base import Backend, check_grads
from sparsecore.backends.xla_optimizers import apply_update
from sparsecore.limits import OVERFLOW_POLICIES
from sparsecore.preprocess import (
    ALIGN,
    PreprocessedBatch,
    StackCSR,
    coo_buffer_size_per_device,
    preprocess_inputs,
    row_pointers_per_sc,
)
from sparsecore.stacking import StackedTable, StackingPlan, stack_rows, unstack_rows
from sparsecore.validation import FeatureInput


def to_jax(tensor: torch.Tensor) -> jax.Array:
    return jnp.asarray(tensor.detach().contiguous().numpy())


def to_torch(array: jax.Array) -> torch.Tensor:
    return torch.from_numpy(np.array(array))


class StackGeometry:
    """Static shapes of one stack's CSR buffers (hashable, so jit can specialise on it)."""

    def __init__(self, stack: StackedTable, devices: int, sparsecores_per_device: int):
        self.chunks = devices * sparsecores_per_device
        self.n = stack.num_sparsecores
        self.width = row_pointers_per_sc(stack)
        self.region = coo_buffer_size_per_device(stack, sparsecores_per_device) // sparsecores_per_device
        self.rows = stack.vocab_size
        self.shard_rows = stack.shard_rows
        self.samples_per_chunk = stack.total_sample_count // self.chunks
        self._key = (self.chunks, self.n, self.width, self.region, self.rows, self.shard_rows, self.samples_per_chunk)

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StackGeometry) and self._key == other._key


def csr_entries(geo: StackGeometry, row_pointers, embedding_ids, sample_ids, gains):
    """Flat (physical row, stack sample, gain, valid) of every COO slot, as the SparseCores read
    them: entries of partition p of a source SC lie in [round_up(end[p-1], 8), end[p])."""
    ends = row_pointers.reshape(geo.chunks, geo.width)[:, : geo.n]
    starts = jnp.concatenate([jnp.zeros((geo.chunks, 1), ends.dtype), (ends[:, :-1] + ALIGN - 1) // ALIGN * ALIGN], 1)
    position = jnp.arange(geo.region, dtype=ends.dtype)
    dest = jax.vmap(lambda s: jnp.searchsorted(s, position, side="right") - 1)(starts)
    valid = position[None, :] < jnp.take_along_axis(ends, dest, axis=1)
    ids = embedding_ids.reshape(geo.chunks, geo.region)
    phys = jnp.where(valid, dest * geo.shard_rows + ids, 0)
    chunk = jnp.arange(geo.chunks, dtype=ids.dtype)[:, None]
    sample = jnp.where(valid, chunk * geo.samples_per_chunk + sample_ids.reshape(geo.chunks, geo.region), 0)
    gain = jnp.where(valid, gains.reshape(geo.chunks, geo.region), 0.0)
    return phys.reshape(-1), sample.reshape(-1), gain.reshape(-1), valid.reshape(-1)


@partial(jax.jit, static_argnums=0)
def stack_forward(geo: StackGeometry, table, row_pointers, embedding_ids, sample_ids, gains):
    """Pooled activations of the stack's concatenated batch, [chunks * samples_per_chunk, dim]."""
    phys, sample, gain, _ = csr_entries(geo, row_pointers, embedding_ids, sample_ids, gains)
    return jax.ops.segment_sum(gain[:, None] * table[phys], sample, num_segments=geo.chunks * geo.samples_per_chunk)


@partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2, 3))
def stack_backward(geo: StackGeometry, optimizer, table, slots, row_dims, step, activation_grad,
                   row_pointers, embedding_ids, sample_ids, gains):
    """Fused backward: accumulate per touched row, then one optimizer update per row."""
    phys, sample, gain, valid = csr_entries(geo, row_pointers, embedding_ids, sample_ids, gains)
    contributions = gain[:, None] * activation_grad[sample]
    touched, inverse = jnp.unique(jnp.where(valid, phys, geo.rows), size=phys.size, fill_value=geo.rows,
                                  return_inverse=True)
    grad = jax.ops.segment_sum(contributions, inverse.reshape(-1), num_segments=phys.size)
    rows = table.at[touched].get(mode="fill", fill_value=0.0)
    row_slots = {k: v.at[touched].get(mode="fill", fill_value=0.0) for k, v in slots.items()}
    new_rows, new_slots = apply_update(optimizer, rows, row_slots, grad, step, row_dims.at[touched].get(mode="fill", fill_value=1))
    table = table.at[touched].set(new_rows, mode="drop")
    slots = {k: slots[k].at[touched].set(new_slots[k], mode="drop") for k in slots}
    return table, slots


class XlaBackend(Backend):
    """Stacked tables as JAX arrays in the physical (mod-sharded) layout."""

    name = "xla"

    def __init__(self, plan: StackingPlan, weights: Mapping[str, torch.Tensor] | None = None, seed: int = 0,
                 overflow: str = "error"):
        super().__init__(plan, weights, seed)
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow policy must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
        self.overflow = overflow
        devices, s = plan.topology.num_devices, plan.topology.sparsecores_per_device
        self._geometry = {st.name: StackGeometry(st, devices, s) for st in plan.stacks}
        self._tables: dict[str, jax.Array] = {}
        self._slots: dict[str, dict[str, jax.Array]] = {}
        self.load_state(self._initial_weights)
        # only row-wise optimizers need each row's logical dim; others get a 1-element dummy
        self._row_dims = {st.name: jnp.asarray(st.row_dims() if st.optimizer.row_slots else [1], dtype=jnp.float32)
                          for st in plan.stacks}
        self._rows_of_feature = {st.name: _feature_rows(st, devices * s) for st in plan.stacks}

    def _load(self, weights: Mapping[str, torch.Tensor], slots: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        for st in self.plan.stacks:
            self._tables[st.name] = to_jax(stack_rows(st, {t.table: weights[t.table].float() for t in st.tables}))
            self._slots[st.name] = {
                slot: to_jax(stack_rows(st, {t.table: slots[t.table][slot].float() for t in st.tables}))
                for slot in st.optimizer.slot_names
            }

    def forward(self, inputs: Mapping[str, FeatureInput]) -> tuple[dict[str, torch.Tensor], PreprocessedBatch]:
        batch = preprocess_inputs(inputs, self.plan, overflow=self.overflow)
        self.last_stats = batch.stats
        out = {}
        for stack in self.plan.stacks:
            activations = self.stack_activations(stack, batch.stacks[stack.name])
            for fp in stack.features:
                rows = self._rows_of_feature[stack.name][fp.feature]
                out[fp.feature] = to_torch(activations[rows, : self.plan.tables[fp.table].dim])
        return out, batch

    def backward(self, context: PreprocessedBatch, grads: Mapping[str, torch.Tensor]) -> None:
        check_grads(self.plan, grads)
        self.steps += 1
        for stack in self.plan.stacks:
            geo = self._geometry[stack.name]
            activation_grad = np.zeros((geo.chunks * geo.samples_per_chunk, stack.dim), dtype=np.float32)
            for fp in stack.features:
                rows = self._rows_of_feature[stack.name][fp.feature]
                activation_grad[rows, : self.plan.tables[fp.table].dim] = grads[fp.feature].detach().numpy()
            self._update(stack, context.stacks[stack.name], activation_grad)

    def stack_activations(self, stack: StackedTable, csr: StackCSR) -> jax.Array:
        """Stacked activations [chunks * samples_per_chunk, dim], device-major."""
        return stack_forward(self._geometry[stack.name], self._tables[stack.name], csr.row_pointers,
                             csr.embedding_ids, csr.sample_ids, csr.gains)

    def _update(self, stack: StackedTable, csr: StackCSR, activation_grad: np.ndarray) -> None:
        self._tables[stack.name], self._slots[stack.name] = stack_backward(
            self._geometry[stack.name], stack.optimizer, self._tables[stack.name], self._slots[stack.name],
            self._row_dims[stack.name], jnp.int32(self.steps), activation_grad, csr.row_pointers,
            csr.embedding_ids, csr.sample_ids, csr.gains,
        )

    def table_weights(self) -> dict[str, torch.Tensor]:
        out = {}
        for stack in self.plan.stacks:
            out.update(unstack_rows(stack, to_torch(self._tables[stack.name])))
        return out

    def optimizer_slots(self) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {name: {} for name in self.plan.tables}
        for stack in self.plan.stacks:
            for slot, values in self._slots[stack.name].items():
                for table, tensor in unstack_rows(stack, to_torch(values)).items():
                    out[table][slot] = tensor
        return out


def _feature_rows(stack: StackedTable, chunks: int) -> dict[str, np.ndarray]:
    """Row of each feature sample in the stack's activations (chunk-major, features inside)."""
    samples_per_chunk = stack.total_sample_count // chunks
    out = {}
    for fp in stack.features:
        per_chunk = fp.batch_size // chunks
        i = np.arange(fp.batch_size)
        out[fp.feature] = (i // per_chunk) * samples_per_chunk + fp.sample_offset // chunks + i % per_chunk
    return out
