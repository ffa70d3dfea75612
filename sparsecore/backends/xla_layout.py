"""Where every feature's pooled rows sit in its stack's activations, and the traced assembly of all
features' outputs from them (and back, for the activation gradients).

A stack's activations are [chunks * samples_per_chunk, dim], chunk-major: chunk k holds samples
[k * b / chunks, (k + 1) * b / chunks) of each of the stack's features, side by side (the layout
jax-tpu-embedding's SparseCore kernels produce). When all features share one batch size the
output is one [batch, sum of dims] matrix in plan feature order (reshapes, no gathers);
otherwise a tuple of per-feature [batch, dim] arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sparsecore.stacking import StackedTable, StackingPlan


class ActivationLayout:
    def __init__(self, plan: StackingPlan, chunks: int):
        self.plan = plan
        self.chunks = chunks
        self.uniform = len({f.batch_size for f in plan.features}) == 1
        self.dims = [plan.tables[f.table].dim for f in plan.features]
        # (stack index, feature index inside the stack) of every feature, in plan order
        where = {fp.feature: (s, j) for s, st in enumerate(plan.stacks) for j, fp in enumerate(st.features)}
        self.where = [where[f.name] for f in plan.features]
        self.offsets = np.cumsum([0] + self.dims).tolist()
        self.rows = [_feature_rows(plan.stacks[s], chunks, j) for s, j in self.where]

    def assemble(self, activations: list[jax.Array]) -> jax.Array | tuple[jax.Array, ...]:
        """All features' outputs from the stacks' activations."""
        if not self.uniform:
            return tuple(activations[s][rows, :dim] for (s, _), rows, dim in zip(self.where, self.rows, self.dims))
        blocks = [self._sample_major(st, a) for st, a in zip(self.plan.stacks, activations)]
        return jnp.concatenate([blocks[s][:, j, :dim] for (s, j), dim in zip(self.where, self.dims)], axis=1)

    def disassemble(self, grad: jax.Array | tuple[jax.Array, ...]) -> list[jax.Array]:
        """The stacks' activation gradients from the gradient of ``assemble``'s output."""
        stacks = self.plan.stacks
        if not self.uniform:
            out = [jnp.zeros((st.total_sample_count, st.dim), jnp.float32) for st in stacks]
            for (s, _), rows, dim, g in zip(self.where, self.rows, self.dims, grad):
                out[s] = out[s].at[rows, :dim].set(g)
            return out
        columns: list[list[jax.Array]] = [[None] * len(st.features) for st in stacks]  # type: ignore[list-item]
        for (s, j), dim, start in zip(self.where, self.dims, self.offsets):
            columns[s][j] = jnp.pad(grad[:, start:start + dim], ((0, 0), (0, stacks[s].dim - dim)))
        return [self._chunk_major(st, jnp.stack(cols, axis=1)) for st, cols in zip(stacks, columns)]

    def _sample_major(self, stack: StackedTable, activations: jax.Array) -> jax.Array:
        """[chunks * samples_per_chunk, dim] -> [batch, features, dim]."""
        f, b = len(stack.features), stack.features[0].batch_size
        blocks = activations.reshape(self.chunks, f, b // self.chunks, stack.dim)
        return blocks.transpose(0, 2, 1, 3).reshape(b, f, stack.dim)

    def _chunk_major(self, stack: StackedTable, values: jax.Array) -> jax.Array:
        """[batch, features, dim] -> [chunks * samples_per_chunk, dim]."""
        f, b = len(stack.features), stack.features[0].batch_size
        blocks = values.reshape(self.chunks, b // self.chunks, f, stack.dim)
        return blocks.transpose(0, 2, 1, 3).reshape(b * f, stack.dim)


def _feature_rows(stack: StackedTable, chunks: int, j: int) -> np.ndarray:
    """Row of each sample of the stack's j-th feature in the stack's activations."""
    fp = stack.features[j]
    samples_per_chunk = stack.total_sample_count // chunks
    per_chunk = fp.batch_size // chunks
    i = np.arange(fp.batch_size)
    return (i // per_chunk) * samples_per_chunk + fp.sample_offset // chunks + i % per_chunk
