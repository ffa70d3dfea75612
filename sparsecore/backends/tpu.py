"""``tpu`` backend: the same host preprocessing and table layout as ``xla``, with the lookup and
the fused update done by jax-tpu-embedding's SparseCore primitives (custom calls only libtpu
executes). On other platforms the programs still lower, which is how they are checked here.

Under the "minibatch" overflow policy every batch goes to the kernels in jax-tpu-embedding's own
minibatching form (``enable_minibatching``): buffers of 64 minibatch slots
(``sparsecore.minibatching.jte_buffers``) and the batch's k as an input, so one program serves
every k.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import Mesh, PartitionSpec
from jax_tpu_embedding.sparsecore.lib.nn import embedding

from sparsecore.backends import TPU
from sparsecore.backends.xla import XlaBackend
from sparsecore.csr_format import StackCSR, coo_buffer_size_per_device, row_pointers_per_sc
from sparsecore.jte_interop import jte_feature_specs, jte_optimizer
from sparsecore.minibatching import jte_buffers, minibatch_entries
from sparsecore.preprocess import preprocess_inputs
from sparsecore.stacking import StackedTable, StackingPlan
from tpu_facts import ALIGNMENT, MAX_MINIBATCHES, round_up

AXIS = "device"


class _StackProgram:
    """The per-device forward and update programs of one stack (``minibatching``: of buffers in
    jax-tpu-embedding's minibatching form)."""

    def __init__(self, plan: StackingPlan, stack: StackedTable, minibatching: bool = False):
        self.stack = stack
        self.minibatching = minibatching
        self.devices = plan.topology.num_devices
        self.s = plan.topology.sparsecores_per_device
        all_specs = jte_feature_specs(plan)
        self.specs = {fp.feature: all_specs[fp.feature] for fp in stack.features}
        self.slot_type = type(jte_optimizer(stack.optimizer).slot_variables_initializers())

    def _input(self, row_pointers, embedding_ids, sample_ids, gains, num_minibatches) -> embedding.PreprocessedInput:
        name = self.stack.name
        csr = embedding.SparseDenseMatmulInput({name: row_pointers}, {name: embedding_ids}, {name: sample_ids},
                                               {name: gains})
        return embedding.PreprocessedInput(csr, num_minibatches)

    def _variables(self, table, slots: Mapping[str, jax.Array]):
        slot_values = self.slot_type(*(slots[name] for name in self.stack.optimizer.slot_names))
        return {self.stack.name: embedding.EmbeddingVariables(table, slot_values)}

    def forward(self, table, row_pointers, embedding_ids, sample_ids, gains, num_minibatches):
        out = embedding.tpu_sparse_dense_matmul(
            self._input(row_pointers, embedding_ids, sample_ids, gains, num_minibatches),
            {self.stack.name: embedding.EmbeddingVariables(table, ())}, self.specs, global_device_count=self.devices,
            num_sc_per_device=self.s, perform_unstacking=False, enable_minibatching=self.minibatching,
        )
        return out[self.stack.name]

    def backward(self, table, slots, step, activation_grad, row_pointers, embedding_ids, sample_ids, gains,
                 num_minibatches):
        updated = embedding.tpu_sparse_dense_matmul_grad(
            {self.stack.name: activation_grad},
            self._input(row_pointers, embedding_ids, sample_ids, gains, num_minibatches),
            self._variables(table, slots), self.specs, global_device_count=self.devices, num_sc_per_device=self.s,
            step=step - 1, perform_stacking=False, enable_minibatching=self.minibatching,
        )[self.stack.name]
        return updated.table, dict(zip(self.stack.optimizer.slot_names, updated.slot))


def _shard(fn, mesh: Mesh | None, replicated: tuple[int, ...] = ()):
    """jit, and shard_map over the devices when there are several (arrays are device-major)."""
    if mesh is None:
        return jax.jit(fn)

    def spec(i):
        return PartitionSpec() if i in replicated else PartitionSpec(AXIS)

    def wrapped(*args):
        in_specs = tuple(jax.tree.map(lambda _: spec(i), a) for i, a in enumerate(args))
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=PartitionSpec(AXIS), check_vma=False)(*args)

    return jax.jit(wrapped)


class TpuBackend(XlaBackend):
    """SparseCore kernels on the TPUs of ``jax.devices()`` (one JAX device per topology device)."""

    name = TPU

    def __init__(self, plan: StackingPlan, weights: Mapping[str, torch.Tensor] | None = None, seed: int = 0,
                 overflow: str = "error"):
        devices = [d for d in jax.devices() if d.platform == "tpu"]
        if len(devices) < plan.topology.num_devices:
            raise RuntimeError(
                f"the tpu backend needs {plan.topology.num_devices} TPU devices for {plan.topology}, found "
                f"{len(devices)} (platform {jax.devices()[0].platform}); use backend='xla' for the same "
                "semantics on this machine"
            )
        super().__init__(plan, weights, seed, overflow)
        mesh = Mesh(np.array(devices[: plan.topology.num_devices]), (AXIS,)) if len(devices) > 1 else None
        self._stack_programs = {st.name: _StackProgram(plan, st, overflow == "minibatch") for st in plan.stacks}
        self._forward = {n: _shard(p.forward, mesh) for n, p in self._stack_programs.items()}
        self._backward = {n: _shard(p.backward, mesh, replicated=(2,)) for n, p in self._stack_programs.items()}

    def _host_inputs(self, inputs):
        devices, s = self.plan.topology.num_devices, self.plan.topology.sparsecores_per_device
        if self.overflow == "minibatch":
            entries = [minibatch_entries(st, inputs, devices, s) for st in self.plan.stacks]
            csrs = [jte_buffers(st, e, devices, s) for st, e in zip(self.plan.stacks, entries)]
            counts = [np.full(devices, e.num_minibatches, np.int32) for e in entries]
        else:
            batch = preprocess_inputs(inputs, self.plan, overflow=self.overflow)
            csrs = [batch.stacks[st.name] for st in self.plan.stacks]
            counts = [np.ones(devices, np.int32)] * len(csrs)
        return (tuple((c.row_pointers, c.embedding_ids, c.sample_ids, c.gains, k) for c, k in zip(csrs, counts)),
                {st.name: c.stats for st, c in zip(self.plan.stacks, csrs)})

    def stack_activations(self, stack: StackedTable, csr: StackCSR) -> jax.Array:
        return self._forward[stack.name](self._tables[stack.name], csr.row_pointers, csr.embedding_ids,
                                         csr.sample_ids, csr.gains, np.ones(self.plan.topology.num_devices, np.int32))

    def _stack_lookup(self, stack: StackedTable, table: jax.Array, device_input) -> jax.Array:
        return self._layout.from_chunk_major(stack, self._forward[stack.name](table, *device_input))

    def _stack_grads(self, grad) -> list[jax.Array]:
        return self._layout.disassemble(grad)

    def _stack_update(self, stack: StackedTable, table, slots, row_dims, step, hyper_inputs, activation_grad,
                      device_input):
        return self._backward[stack.name](table, slots, step, self._layout.to_chunk_major(stack, activation_grad),
                                          *device_input)


def lowered_programs(plan: StackingPlan, stack_name: str, minibatching: bool = False) -> tuple[str, str]:
    """StableHLO text of one stack's single-device forward and update programs (no TPU needed;
    ``minibatching``: as the "minibatch" policy runs them)."""
    if plan.topology.num_devices != 1:
        raise ValueError("lowering without devices is single-device only; use a one-device topology")
    stack = plan.stack(stack_name)
    program = _StackProgram(plan, stack, minibatching)
    s = plan.topology.sparsecores_per_device
    slots = MAX_MINIBATCHES if minibatching else 1
    coo = coo_buffer_size_per_device(stack, s) if slots == 1 else \
        round_up(stack.max_ids_per_partition, ALIGNMENT) * s * stack.num_sparsecores * slots

    def arr(shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype)

    csr = (arr((s * slots * row_pointers_per_sc(stack),), jnp.int32), arr((coo,), jnp.int32), arr((coo,), jnp.int32),
           arr((coo,)), arr((1,), jnp.int32))
    table = arr((stack.vocab_size, stack.dim))
    slots = {name: table for name in stack.optimizer.slot_names}
    grad = arr((stack.total_sample_count, stack.dim))
    forward = jax.jit(program.forward).lower(table, *csr).as_text()
    backward = jax.jit(program.backward).lower(table, slots, jnp.int32(1), grad, *csr).as_text()
    return forward, backward
