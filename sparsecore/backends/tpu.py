"""``tpu`` backend: the same host preprocessing and table layout as ``xla``, with the lookup and
the fused update done by jax-tpu-embedding's SparseCore primitives (custom calls only libtpu
executes). On other platforms the programs still lower, which is how they are checked here.
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
from sparsecore.limits import ONE_PASS_POLICIES, check_overflow_policy
from sparsecore.preprocess import preprocess_inputs
from sparsecore.stacking import StackedTable, StackingPlan

AXIS = "device"


class _StackProgram:
    """The per-device forward and update programs of one stack."""

    def __init__(self, plan: StackingPlan, stack: StackedTable):
        self.stack = stack
        self.devices = plan.topology.num_devices
        self.s = plan.topology.sparsecores_per_device
        all_specs = jte_feature_specs(plan)
        self.specs = {fp.feature: all_specs[fp.feature] for fp in stack.features}
        self.slot_type = type(jte_optimizer(stack.optimizer).slot_variables_initializers())

    def _input(self, row_pointers, embedding_ids, sample_ids, gains) -> embedding.PreprocessedInput:
        name = self.stack.name
        csr = embedding.SparseDenseMatmulInput({name: row_pointers}, {name: embedding_ids}, {name: sample_ids},
                                               {name: gains})
        return embedding.PreprocessedInput(csr, jnp.ones((1,), jnp.int32))

    def _variables(self, table, slots: Mapping[str, jax.Array]):
        slot_values = self.slot_type(*(slots[name] for name in self.stack.optimizer.slot_names))
        return {self.stack.name: embedding.EmbeddingVariables(table, slot_values)}

    def forward(self, table, row_pointers, embedding_ids, sample_ids, gains):
        out = embedding.tpu_sparse_dense_matmul(
            self._input(row_pointers, embedding_ids, sample_ids, gains),
            {self.stack.name: embedding.EmbeddingVariables(table, ())}, self.specs, global_device_count=self.devices,
            num_sc_per_device=self.s, perform_unstacking=False,
        )
        return out[self.stack.name]

    def backward(self, table, slots, step, activation_grad, row_pointers, embedding_ids, sample_ids, gains):
        updated = embedding.tpu_sparse_dense_matmul_grad(
            {self.stack.name: activation_grad}, self._input(row_pointers, embedding_ids, sample_ids, gains),
            self._variables(table, slots), self.specs, global_device_count=self.devices, num_sc_per_device=self.s,
            step=step - 1, perform_stacking=False,
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
        check_overflow_policy(overflow, ONE_PASS_POLICIES, "the tpu backend (one kernel pass a step)")
        super().__init__(plan, weights, seed, overflow)
        mesh = Mesh(np.array(devices[: plan.topology.num_devices]), (AXIS,)) if len(devices) > 1 else None
        self._stack_programs = {st.name: _StackProgram(plan, st) for st in plan.stacks}
        self._forward = {n: _shard(p.forward, mesh) for n, p in self._stack_programs.items()}
        self._backward = {n: _shard(p.backward, mesh, replicated=(2,)) for n, p in self._stack_programs.items()}

    def _host_inputs(self, inputs):
        batch = preprocess_inputs(inputs, self.plan, overflow=self.overflow)
        csrs = [batch.stacks[st.name] for st in self.plan.stacks]
        return tuple((c.row_pointers, c.embedding_ids, c.sample_ids, c.gains) for c in csrs), batch.stats

    def stack_activations(self, stack: StackedTable, csr: StackCSR) -> jax.Array:
        return self._forward[stack.name](self._tables[stack.name], csr.row_pointers, csr.embedding_ids,
                                         csr.sample_ids, csr.gains)

    def _stack_lookup(self, stack: StackedTable, table: jax.Array, device_input) -> jax.Array:
        return self._layout.from_chunk_major(stack, self._forward[stack.name](table, *device_input))

    def _stack_grads(self, grad) -> list[jax.Array]:
        return self._layout.disassemble(grad)

    def _stack_update(self, stack: StackedTable, table, slots, row_dims, step, hyper_inputs, activation_grad,
                      device_input):
        return self._backward[stack.name](table, slots, step, self._layout.to_chunk_major(stack, activation_grad),
                                          *device_input)


def lowered_programs(plan: StackingPlan, stack_name: str) -> tuple[str, str]:
    """StableHLO text of one stack's single-device forward and update programs (no TPU needed)."""
    if plan.topology.num_devices != 1:
        raise ValueError("lowering without devices is single-device only; use a one-device topology")
    stack = plan.stack(stack_name)
    program = _StackProgram(plan, stack)
    s = plan.topology.sparsecores_per_device
    coo = coo_buffer_size_per_device(stack, s)

    def arr(shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype)

    csr = (arr((s * row_pointers_per_sc(stack),), jnp.int32), arr((coo,), jnp.int32), arr((coo,), jnp.int32),
           arr((coo,)))
    table = arr((stack.vocab_size, stack.dim))
    slots = {name: table for name in stack.optimizer.slot_names}
    grad = arr((stack.total_sample_count, stack.dim))
    forward = jax.jit(program.forward).lower(table, *csr).as_text()
    backward = jax.jit(program.backward).lower(table, slots, jnp.int32(1), grad, *csr).as_text()
    return forward, backward
