"""``xla`` backend: the SparseCore lookup semantics in pure JAX, compiled to one program per step
phase.

It consumes exactly the CSR buffers the SparseCores get (``sparsecore.preprocess``) and runs on
the default JAX device: the program a TPU's TensorCore would run, and the reference for the
``tpu`` backend. Forward: activation[sample] = sum of gain * row over the sample's entries.
Backward: per touched row, g = sum(gain * d_activation[sample]) over all its entries, then one
fused optimizer update of that row and its slots; other rows are untouched.

``prepare`` (host, may run ahead on a prefetch thread) takes the entries the CSR buffers would
hold, in row order (``preprocess_row_ordered``), lists every touched row once (``xla_inputs``) and
compiles the step's programs for their bucketed sizes: ONE program looks up all stacks and
assembles the output, ONE applies the gradient and the optimizer to all stacks (tables updated in
place, donated). Only touched rows are read or written.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

import xla_cache
from sparsecore.backends import XLA
from sparsecore.backends.base import ReadsTablesAlone, check_grads
from sparsecore.backends.xla_inputs import stack_input
from sparsecore.backends.xla_layout import ActivationLayout
from sparsecore.csr_format import StackCSR
from sparsecore.csr_math import row_ordered
from sparsecore.entries import DEFAULT_BUCKETS, Buckets, lookup, pack_row_ordered, update
from sparsecore.limits import ProposedLimits, StackStats, check_overflow_policy
from sparsecore.optimizer_rules import rule_of
from sparsecore.preprocess import preprocess_row_ordered
from sparsecore.stacked_arrays import reset_table_rows, stacked_array, unstack_table
from sparsecore.stacking import StackedTable, StackingPlan
from sparsecore.validation import FeatureInput

xla_cache.install()  # the persistent compile cache every job shares (without the tpu device)


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """``tensor`` as a host array, which the compiled programs take as it is (no copy here; an
    import into JAX per call costs more than the program's own transfer)."""
    return tensor.detach().contiguous().numpy()


def to_torch(array: jax.Array) -> torch.Tensor:
    """``array`` as a CPU tensor (no copy; waits for it)."""
    return torch.from_dlpack(array)


@dataclass(frozen=True)
class PreparedLookup:
    """A batch ready for the device: per stack, the backend's input arrays (host arrays: the
    compiled programs take them as they are, cheaper than a transfer call per batch)."""

    arrays: tuple[Any, ...]
    stats: dict[str, StackStats]
    key: tuple  # the arrays' shapes: which compiled programs serve this batch


def step_hypers(optimizer, step: int) -> np.ndarray:
    """The hyperparameters of ``optimizer``'s update number ``step`` an update program takes as
    inputs (its rule's ``program_inputs``, as the fused op takes them), computed on the host in
    double, as float32."""
    rule = rule_of(optimizer)
    values = rule.op_hypers(optimizer, step if rule.varies else None)
    return np.asarray([values[k] for k in rule.program_inputs], np.float32)


def program_hypers(optimizer, inputs: jax.Array) -> list[Any]:
    """All of ``optimizer``'s op hyperparameters inside an update program: its ``inputs``
    (:func:`step_hypers`) where the rule says so, the others as numbers."""
    rule = rule_of(optimizer)
    values: list[Any] = rule.op_hypers(optimizer, 1 if rule.varies else None)
    for j, k in enumerate(rule.program_inputs):
        values[k] = inputs[j]
    return values


class XlaBackend(ReadsTablesAlone):
    """Stacked tables as JAX arrays in the physical (mod-sharded) layout."""

    name = XLA

    def __init__(self, plan: StackingPlan, weights: Mapping[str, torch.Tensor] | None = None, seed: int = 0,
                 overflow: str = "error", buckets: Buckets = DEFAULT_BUCKETS):
        super().__init__(plan)
        self.overflow = check_overflow_policy(overflow)
        self.buckets = buckets
        self._layout = ActivationLayout(plan, plan.topology.num_sparsecores)
        self._rows = [self._layout.activation_rows(st) for st in plan.stacks]
        self._tables: dict[str, jax.Array] = {}
        self._slots: dict[str, dict[str, jax.Array]] = {}
        self._load_initial(weights, seed)
        # only row-wise optimizers need each row's logical dim; others get a 1-element dummy
        self._row_dims = tuple(jnp.asarray(st.row_dims() if st.optimizer.row_slots else [1], dtype=jnp.float32)
                               for st in plan.stacks)
        self._state_shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                          (self._table_tuple(), self._slot_tuple(), self._row_dims))
        self._hyper_input_shapes = tuple(jax.ShapeDtypeStruct((len(rule_of(st.optimizer).program_inputs),), jnp.float32)
                                     for st in plan.stacks)
        self._lookup_jit = jax.jit(self._lookup_program)
        self.learning_rate_scale = 1.0  # every stack's rate times this (set_learning_rate_scale)
        self._update_jit = jax.jit(self._update_program, donate_argnums=(0, 1))
        self._programs: dict[tuple, tuple[Any, Any]] = {}
        self._compile_lock = threading.Lock()

    def _load(self, weights: Mapping[str, torch.Tensor], slots: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Each stack built on the device one table at a time (``weights`` / ``slots`` may make
        them on access); a reload refills the arrays where they are, so each stack exists once."""
        for st in self.plan.stacks:
            self._tables[st.name] = stacked_array(st, lambda table: weights[table], False, self._tables.get(st.name))
            old = self._slots.get(st.name, {})
            self._slots[st.name] = {slot: stacked_array(st, lambda table: slots[table][slot],
                                                        slot in st.optimizer.row_slots, old.get(slot))
                                    for slot in st.optimizer.slot_names}

    # -- per-stack device work (the tpu backend swaps in the SparseCore kernels) --

    def _host_inputs(self, inputs: Mapping[str, FeatureInput]) -> tuple[tuple[Any, ...], dict[str, StackStats]]:
        """Every stack's device input (in plan order) and its partition stats."""
        by_stack = preprocess_row_ordered(inputs, self.plan, overflow=self.overflow)
        stacks = self.plan.stacks
        return (tuple(stack_input(by_stack[st.name], st.vocab_size, rows, self.buckets)
                      for st, rows in zip(stacks, self._rows)),
                {st.name: by_stack[st.name].stats for st in stacks})

    def _stack_lookup(self, stack: StackedTable, table: jax.Array, device_input: Any) -> jax.Array:
        packed, strategy = device_input
        return lookup(packed.unpack(), table, stack.total_sample_count, strategy)

    def _stack_update(self, stack: StackedTable, table, slots, row_dims, step, hyper_inputs, activation_grad,
                      device_input):
        new = update(device_input[0].unpack(), table, tuple(slots.values()), activation_grad, rule_of(stack.optimizer),
                     program_hypers(stack.optimizer, hyper_inputs), row_dims)
        return new[0], dict(zip(slots, new[1:]))

    # -- the two step programs --

    def _lookup_program(self, tables, inputs):
        stacks = self.plan.stacks
        return self._layout.assemble([self._stack_lookup(st, t, x) for st, t, x in zip(stacks, tables, inputs)])

    def _stack_grads(self, grad) -> list[Any]:
        """Every stack's activation gradient as ``_stack_update`` takes it: a function of
        activation rows, reading them from the output gradient itself where its rows are stack
        rows (``row_view``: no per-feature slices), else from the disassembled gradients."""
        if self._layout.row_view:
            out_rows = grad.reshape(-1, self.plan.stacks[0].dim)
            return [lambda rows, s=s: out_rows[self._layout.output_rows(s, rows)] for s in range(len(self.plan.stacks))]
        return [lambda rows, g=g: g[rows] for g in self._layout.disassemble(grad)]

    def _update_program(self, tables, slots, row_dims, step, hyper_inputs, grad, inputs):
        activation_grads = self._stack_grads(grad)
        updated = [self._stack_update(st, *args) for st, *args in
                   zip(self.plan.stacks, tables, slots, row_dims, [step] * len(tables), hyper_inputs, activation_grads,
                       inputs)]
        return tuple(t for t, _ in updated), tuple(s for _, s in updated)

    def set_partition_limits(self, limits: Mapping[str, tuple[int, int]]) -> None:
        """(The programs' shapes come from each batch's entries, not the limits: nothing recompiles.)"""
        self.plan = self.plan.with_limits({name: ProposedLimits(ids, unique, 0)
                                           for name, (ids, unique) in limits.items()})

    def prepare(self, inputs: Mapping[str, FeatureInput]) -> PreparedLookup:
        arrays, stats = self._host_inputs(inputs)
        leaves, structure = jax.tree.flatten(arrays)
        key = (structure, tuple((a.shape, a.dtype.str) for a in leaves))
        prepared = PreparedLookup(arrays, stats, key)
        self.compile(prepared)
        return prepared

    def compile(self, prepared: PreparedLookup) -> None:
        self._compiled(prepared)

    def _compiled(self, prepared: PreparedLookup) -> tuple[Any, Any]:
        programs = self._programs.get(prepared.key)
        if programs is not None:
            return programs
        with self._compile_lock:
            if prepared.key not in self._programs:
                tables, slots, row_dims = self._state_shapes
                inputs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), prepared.arrays)
                grad = jax.eval_shape(self._lookup_program, tables, inputs)
                with xla_cache.persistent():  # whole step programs: a second run loads them
                    self._programs[prepared.key] = (
                        self._lookup_jit.lower(tables, inputs).compile(),
                        self._update_jit.lower(tables, slots, row_dims, jax.ShapeDtypeStruct((), jnp.int32),
                                               self._hyper_input_shapes, grad, inputs).compile(),
                    )
            return self._programs[prepared.key]

    def lookup(self, prepared: Any) -> tuple[torch.Tensor, PreparedLookup]:
        if not self._layout.uniform:
            raise ValueError("lookup() needs one batch size for all features; use forward()")
        out, prepared = self._run_lookup(prepared)
        return to_torch(out), prepared

    def _run_lookup(self, prepared: Any) -> tuple[Any, PreparedLookup]:
        if not isinstance(prepared, PreparedLookup):
            prepared = self.prepare(prepared)
        self.last_stats = prepared.stats
        return self._compiled(prepared)[0](self._table_tuple(), prepared.arrays), prepared

    def set_learning_rate_scale(self, scale: float) -> None:
        """Every stack's learning rate times ``scale`` from the next update on (a warmup's or a
        decay's step). Each rule's rate is an input of the compiled update programs
        (``program_inputs`` holds position 0), so nothing recompiles."""
        if not scale > 0:
            raise ValueError(f"learning-rate scale {scale!r}: it must be > 0 (the optimizer specs' rates are)")
        self.learning_rate_scale = float(scale)

    def update(self, context: PreparedLookup, grad: Any) -> None:
        self.steps += 1
        if isinstance(grad, torch.Tensor):
            grad = host_array(grad)
        scale = self.learning_rate_scale
        hyper_inputs = tuple(step_hypers(st.optimizer if scale == 1.0 else replace(
            st.optimizer, learning_rate=st.optimizer.learning_rate * scale), self.steps) for st in self.plan.stacks)
        self._set_state(self._compiled(context)[1](*self._state(), self._row_dims, np.int32(self.steps), hyper_inputs,
                                                  grad, context.arrays))

    def _state(self) -> tuple[tuple[jax.Array, ...], tuple[dict[str, jax.Array], ...]]:
        """(tables, optimizer slots) per stack in plan order: what the update program replaces."""
        return self._table_tuple(), self._slot_tuple()

    def _set_state(self, state: tuple[tuple[jax.Array, ...], tuple[dict[str, jax.Array], ...]]) -> None:
        """Take (tables, slots) an update program returned."""
        for st, table, table_slots in zip(self.plan.stacks, *state):
            self._tables[st.name], self._slots[st.name] = table, table_slots

    def forward(self, inputs: Mapping[str, FeatureInput]) -> tuple[dict[str, torch.Tensor], PreparedLookup]:
        out, prepared = self._run_lookup(inputs)
        names = [f.name for f in self.plan.features]
        if not self._layout.uniform:
            return {name: to_torch(a) for name, a in zip(names, out)}, prepared
        return dict(zip(names, torch.split(to_torch(out), self._layout.dims, dim=1))), prepared

    def backward(self, context: PreparedLookup, grads: Mapping[str, torch.Tensor]) -> None:
        check_grads(self.plan, grads)
        ordered = [grads[f.name] for f in self.plan.features]
        self.update(context, torch.cat(ordered, dim=1) if self._layout.uniform else tuple(map(host_array, ordered)))

    def stack_activations(self, stack: StackedTable, csr: StackCSR) -> jax.Array:
        """One stack's activations [chunks * samples_per_chunk, dim] (chunk-major) from its CSR
        buffers, read as the SparseCores read them."""
        ro = row_ordered(csr, stack.vocab_size, stack.total_sample_count)
        entries = pack_row_ordered(ro.phys, ro.sample, ro.gain, stack.vocab_size, self.buckets)
        return jax.jit(lambda table, packed: lookup(packed.unpack(), table, stack.total_sample_count))(
            self._tables[stack.name], entries)

    def _table_tuple(self) -> tuple[jax.Array, ...]:
        return tuple(self._tables[st.name] for st in self.plan.stacks)

    def _slot_tuple(self) -> tuple[dict[str, jax.Array], ...]:
        return tuple(self._slots[st.name] for st in self.plan.stacks)

    def reset_rows(self, table: str, rows: torch.Tensor, weights: torch.Tensor, slots: Mapping[str, float]) -> None:
        """(Writes those rows of the stacked arrays alone: :func:`~sparsecore.stacked_arrays.reset_table_rows`.)"""
        _, stack = self.plan.stack_of_table(table)
        held = self._slots[stack.name]
        new = reset_table_rows(stack, table, [self._tables[stack.name], *(held[slot] for slot in slots)],
                               rows.numpy(), weights.numpy(), list(slots.values()))
        self._tables[stack.name] = new[0]
        held.update(zip(slots, new[1:]))

    def table_value(self, table: str, slot: str | None = None) -> torch.Tensor:
        """(Gathers that table's rows alone.)"""
        _, stack = self.plan.stack_of_table(table)
        array = self._tables[stack.name] if slot is None else self._slots[stack.name][slot]
        return unstack_table(stack, array, table)
