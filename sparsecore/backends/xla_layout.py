"""Where every feature's pooled rows sit in its stack's activations, and the traced assembly of all
features' outputs from them (and back, for the activation gradients).

The SparseCores produce a stack's activations chunk-major: [chunks * samples_per_chunk, dim],
chunk k holding samples [k * b / chunks, (k + 1) * b / chunks) of each of the stack's features,
side by side. When all features share one batch size b the layout is sample-major instead,
row i * features + j for sample i of the stack's j-th feature, so that the output, one
[b, sum of dims] matrix in plan feature order, is a reshape (no gathers, no transposes); otherwise
the rows stay chunk-major and the output is a tuple of per-feature [batch, dim] arrays.

When moreover every feature's dim is the one dim of all stacks (``row_view``), each [dim] block of
the output is one activation row of its stack: the output is [b * F, dim] rows, and the update
reads the rows of its activation gradients straight from the output's gradient (no slices).
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
        self.rows = [_chunk_major_rows(plan.stacks[s], chunks, j) for s, j in self.where]
        # the output is the stacks' activations side by side: features in stack order, full dims
        self.concatenated = self.uniform and self.where == [(s, j) for s, st in enumerate(plan.stacks)
                                                            for j in range(len(st.features))] and all(
            dim == plan.stacks[s].dim for (s, _), dim in zip(self.where, self.dims))
        self.row_view = self.uniform and len({st.dim for st in plan.stacks}) == 1 and all(
            dim == plan.stacks[s].dim for (s, _), dim in zip(self.where, self.dims))
        # plan index of each stack's j-th feature
        self._plan_index = [np.zeros(len(st.features), dtype=np.int32) for st in plan.stacks]
        for k, (s, j) in enumerate(self.where):
            self._plan_index[s][j] = k
        self._sources = [] if self.uniform else [self._gradient_sources(s) for s in range(len(plan.stacks))]

    def _gradient_sources(self, s: int) -> np.ndarray:
        """Per chunk-major activation row of stack ``s``: its row in the stack's features' gradients
        stacked in plan order, then one zero row (for rows no feature fills)."""
        source = np.full(self.plan.stacks[s].total_sample_count, -1, dtype=np.int64)
        start = 0
        for (t, _), rows in zip(self.where, self.rows):
            if t == s:
                source[rows] = start + np.arange(rows.size)
                start += rows.size
        source[source < 0] = start
        return source

    def activation_rows(self, stack: StackedTable) -> np.ndarray:
        """Layout row of every chunk-major activation row of ``stack``."""
        s = stack.total_sample_count
        if not self.uniform:
            return np.arange(s)
        f, per_chunk = len(stack.features), stack.features[0].samples // self.chunks
        r = np.arange(s)
        within = r % (s // self.chunks)
        return ((r // (s // self.chunks)) * per_chunk + within % per_chunk) * f + within // per_chunk

    def assemble(self, activations: list[jax.Array]) -> jax.Array | tuple[jax.Array, ...]:
        """All features' outputs from the stacks' activations (in this layout)."""
        if not self.uniform:
            return tuple(activations[s][rows, :dim] for (s, _), rows, dim in zip(self.where, self.rows, self.dims))
        b = self.plan.features[0].batch_size
        blocks = [a.reshape(b, -1) for a in activations]
        if self.concatenated:
            return blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=1)
        return jnp.concatenate([blocks[s][:, j * self.plan.stacks[s].dim:][:, :dim]
                                for (s, j), dim in zip(self.where, self.dims)], axis=1)

    def disassemble(self, grad: jax.Array | tuple[jax.Array, ...]) -> list[jax.Array]:
        """The stacks' activation gradients (in this layout) from the gradient of ``assemble``'s
        output."""
        stacks = self.plan.stacks
        if not self.uniform:  # a gather per stack (XLA:CPU scatters element by element)
            parts: list[list[jax.Array]] = [[] for _ in stacks]
            for (s, _), dim, g in zip(self.where, self.dims, grad):
                parts[s].append(jnp.pad(g, ((0, 0), (0, stacks[s].dim - dim))))
            return [jnp.concatenate([*p, jnp.zeros((1, st.dim), jnp.float32)])[source]
                    for st, p, source in zip(stacks, parts, self._sources)]
        if self.concatenated:
            widths = np.cumsum([len(st.features) * st.dim for st in stacks])[:-1].tolist()
            return [g.reshape(-1, st.dim) for st, g in zip(stacks, jnp.split(grad, widths, axis=1))]
        columns: list[list[jax.Array]] = [[None] * len(st.features) for st in stacks]  # type: ignore[list-item]
        for (s, j), dim, start in zip(self.where, self.dims, self.offsets):
            columns[s][j] = jnp.pad(grad[:, start:start + dim], ((0, 0), (0, stacks[s].dim - dim)))
        return [jnp.stack(cols, axis=1).reshape(-1, st.dim) for st, cols in zip(stacks, columns)]

    def output_rows(self, s: int, rows: jax.Array) -> jax.Array:
        """The rows of the [b * F, dim] view of the output (``row_view``) that stack ``s``'s
        activation ``rows`` are."""
        f = len(self.plan.stacks[s].features)
        return (rows // f) * len(self.dims) + jnp.asarray(self._plan_index[s])[rows % f]

    def from_chunk_major(self, stack: StackedTable, activations: jax.Array) -> jax.Array:
        """A stack's chunk-major activations in this layout."""
        if not self.uniform:
            return activations
        f, b = len(stack.features), stack.features[0].samples
        blocks = activations.reshape(self.chunks, f, b // self.chunks, stack.dim)
        return blocks.transpose(0, 2, 1, 3).reshape(b * f, stack.dim)

    def to_chunk_major(self, stack: StackedTable, activations: jax.Array) -> jax.Array:
        """Inverse of ``from_chunk_major``."""
        if not self.uniform:
            return activations
        f, b = len(stack.features), stack.features[0].samples
        blocks = activations.reshape(self.chunks, b // self.chunks, f, stack.dim)
        return blocks.transpose(0, 2, 1, 3).reshape(b * f, stack.dim)


def _chunk_major_rows(stack: StackedTable, chunks: int, j: int) -> np.ndarray:
    """Chunk-major activation row of each sample of the stack's j-th feature."""
    fp = stack.features[j]
    samples_per_chunk = stack.total_sample_count // chunks
    per_chunk = fp.samples // chunks
    i = np.arange(fp.samples)
    return (i // per_chunk) * samples_per_chunk + fp.sample_offset // chunks + i % per_chunk
