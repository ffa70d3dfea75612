"""``ops`` backend: a rank's stacked tables on the tpu device, looked up and updated by TorchTPU's
SparseCore ops (``torch.ops.tpu.sparse_dense_matmul`` and the fused
``sparse_dense_matmul_grad_with_<optimizer>``, :mod:`torch_tpu.ops.sparsecore`).

:class:`StackedState` (an ``nn.Module``) holds every stack's table and optimizer slots as tpu
buffers (``table_<i>``, ``<slot>_<i>``), its hyperparameters and the index tensors that place the
stacks' chunk-major activations into per-feature outputs. ``prepare`` builds the CSR buffers of a
received batch on the host (``sparsecore.preprocess_inputs``) and cuts each stack's to the batch's
need (:func:`fit_csr`: the partition limit rounded down to a bucket, eight sizes per power of two,
that still holds the batch's largest partition, so the ops run over the real entries plus little
padding, and only a few buffer sizes, hence programs, occur); the ops read that bucket's limits from the buffers'
size (:func:`csr_limits`). Under the "minibatch" overflow policy a stack over its limits goes to the
ops as minibatches instead (:meth:`~sparsecore.csr_sizes.CsrFitter.minibatched`). The lookup calls the lookup op per
stack, the update the fused op per stack, eagerly in place (the table and slots donated to it:
:func:`~torch_tpu.ops.sparsecore_inplace.fused_update_`, no second table). The same
module runs the lookup and, in backward, the update inside a traced step program
(:meth:`StackedState.lookup_with_update`: the step function calls the ops itself, e.g. under
``torch_tpu.compile.train_step``); the buffers' new values are then outputs of that program.

The buffers are not part of a module's ``state_dict``: the sharded modules save the logical
tables and slots (``table_weights`` / ``optimizer_slots``), as every backend's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import torch_tpu  # (registers the tpu device and the tpu:: SparseCore ops)
from sparsecore.backends import OPS
from sparsecore.backends.base import ReadsTablesAlone, check_grads
from sparsecore.backends.xla_layout import ActivationLayout
from sparsecore.csr_sizes import CSR_FIELDS, Agree, CsrFitter, csr_limits, csr_minibatches
from sparsecore.limits import StackStats, check_overflow_policy
from sparsecore.optimizer_rules import OptimizerRule, rule_of
from sparsecore.preprocess import preprocess_inputs
from sparsecore.stacked_arrays import reset_table_rows, stacked_array, unstack_table
from sparsecore.stacking import StackedTable, StackingPlan
from sparsecore.validation import FeatureInput
from torch_tpu.ops.sparsecore import dedups_on_host
from torch_tpu.ops.sparsecore_checks import preprocessed
from torch_tpu.ops.sparsecore_inplace import fused_update_
from torch_tpu.runtime.tensor import concrete_value, write

DEVICE = torch.device("tpu", 0)


@dataclass(frozen=True)
class PreparedCSR:
    """A batch's CSR buffers, four host tensors per stack in plan order, and its partition stats;
    ``touched``: per stack, the fused update's ``touched_rows`` computed with the buffers (empty
    when not: on a TPU, or for a batch prepared without grad, which no update follows)."""

    csr: tuple[torch.Tensor, ...]
    stats: dict[str, StackStats]
    touched: tuple[torch.Tensor, ...] = ()

    @property
    def arguments(self) -> tuple[torch.Tensor, ...]:
        """The tensors :meth:`StackedState.lookup_with_update` takes for this batch."""
        return (*self.csr, *self.touched)


def _fused_op(stack: StackedTable) -> tuple[OptimizerRule, list[bool]]:
    """The rule of ``stack``'s optimizer, and which of its op's hyperparameters are tensors (the
    op's schema says); ValueError where the ops backend cannot run it."""
    rule = rule_of(stack.optimizer)
    if stack.optimizer.row_slots and any(t.dim != stack.dim for t in stack.tables):
        # the op averages g^2 over the stack's (padded) dim, the spec over each table's own dim
        raise ValueError(f"stack {stack.name!r}: {stack.optimizer.name} on tables of dims "
                         f"{sorted({t.dim for t in stack.tables})} padded to {stack.dim}: the ops backend "
                         "averages over the padded dim; use the xla backend")
    if not hasattr(torch.ops.tpu, rule.op_name):
        raise ValueError(f"the ops backend has no fused op for optimizer {stack.optimizer.name!r}")
    arguments = getattr(torch.ops.tpu, rule.op_name).default._schema.arguments
    names = [a.name for a in arguments]
    hypers = arguments[names.index("activations_grad") + 1:names.index("device_batch_size")]
    return rule, [isinstance(a.type, torch.TensorType) for a in hypers]


class StackedState(nn.Module):
    """Every stack of ``plan`` as tpu buffers (uninitialised: the backend loads them), and the
    lookup / fused update over them. ``fixed_layout``: the activations are permuted by index
    buffers even where the permutation is the identity, so that plans of the same shapes give
    programs of the same inputs (ranks running one SPMD program)."""

    def __init__(self, plan: StackingPlan, fixed_layout: bool = False) -> None:
        super().__init__()
        self.plan = plan
        chunks = plan.topology.num_sparsecores
        self.chunks = chunks
        self.uniform = len({f.batch_size for f in plan.features}) == 1
        where = {fp.feature: (s, j) for s, st in enumerate(plan.stacks) for j, fp in enumerate(st.features)}
        self._where = [where[f.name] for f in plan.features]
        self._dims = [plan.tables[f.table].dim for f in plan.features]
        self._identity: list[bool] = []
        self._tensor_hypers: list[list[bool]] = []  # per stack: which of its op's hyperparameters are tensors
        layout = ActivationLayout(plan, chunks)  # where each feature's rows sit in the chunk-major activations
        plan_index = {where: k for k, where in enumerate(self._where)}
        for i, st in enumerate(plan.stacks):
            rule, tensor_hypers = _fused_op(st)
            self._tensor_hypers.append(tensor_hypers)
            for name in ("table", *st.optimizer.slot_names):  # (allocated by load: each exists once)
                self.register_buffer(f"{name}_{i}", None, persistent=False)
            if rule.in_step:  # fixed: the tensor ones are buffers (inputs of a step program)
                for k, (value, tensor) in enumerate(zip(rule.op_hypers(st.optimizer, None), tensor_hypers)):
                    if tensor:
                        self.register_buffer(f"hyper{k}_{i}", torch.tensor(float(value), device=DEVICE),
                                             persistent=False)
            if layout.row_view:
                continue
            # one batch size: sample-major rows (sample i's features side by side: [b, F * dim] is a
            # reshape); else feature-major (feature j's samples contiguous: a split per feature)
            order = np.argsort(layout.activation_rows(st)) if self.uniform else np.concatenate(
                [layout.rows[plan_index[(i, j)]] for j in range(len(st.features))])
            identity = not fixed_layout and bool(np.array_equal(order, np.arange(order.size)))
            self._identity.append(identity)
            if not identity:
                self.register_buffer(f"perm_{i}", torch.from_numpy(order).to(DEVICE), persistent=False)
                self.register_buffer(f"inverse_{i}", torch.from_numpy(np.argsort(order)).to(DEVICE),
                                     persistent=False)
        self._row_view = layout.row_view
        self._columns = None
        if self._row_view:
            # every output row is one stack activation row: ONE row gather places them all (a
            # per-stack row permutation then a column permutation of [b, F * dim] cost two
            # gathers, the second strided, which XLA:CPU runs element by element)
            sizes = [st.total_sample_count for st in plan.stacks]
            source = np.empty(sum(sizes), dtype=np.int64)
            for i, (st, start) in enumerate(zip(plan.stacks, np.cumsum([0] + sizes[:-1]))):
                chunk_major = layout.activation_rows(st)
                source[np.asarray(layout.output_rows(i, chunk_major))] = start + np.arange(chunk_major.size)
            self._stack_rows = sizes
            if fixed_layout or not np.array_equal(source, np.arange(source.size)):
                self.register_buffer("rows", torch.from_numpy(source).to(DEVICE), persistent=False)
                # the output row of each stack's activation rows: its fused op reads its gradient
                # rows from the output's (no permuted copy of the whole gradient), and a lone
                # stack's lookup writes them there
                for i, part in enumerate(np.split(np.argsort(source), np.cumsum(sizes)[:-1])):
                    self.register_buffer(f"grad_rows_{i}", torch.from_numpy(part).to(DEVICE), persistent=False)
        elif self.uniform:
            # the stacks' [b, F * dim] blocks side by side; plan feature f is columns
            # offset(stack) + j * stack dim + [0, dim) of them
            starts = np.cumsum([0] + [len(st.features) * st.dim for st in plan.stacks])
            self._width = int(starts[-1])
            columns = np.concatenate([starts[s] + j * plan.stacks[s].dim + np.arange(dim)
                                      for (s, j), dim in zip(self._where, self._dims)])
            if fixed_layout or not np.array_equal(columns, np.arange(self._width)):
                self._columns = "permutation" if columns.size == self._width else "subset"
                self.register_buffer("columns", torch.from_numpy(columns).to(DEVICE), persistent=False)
                if self._columns == "permutation":
                    self.register_buffer("columns_inverse", torch.from_numpy(np.argsort(columns)).to(DEVICE),
                                         persistent=False)

    # -- the tensors ---------------------------------------------------------------------------

    def buffers_now(self) -> dict[str, torch.Tensor]:
        """The buffers by name as they are now (under a trace: the program's inputs; a traced
        backward runs after the trace rebinds them, so it takes them from its forward)."""
        return dict(self.named_buffers())

    def step_tensors(self, buffers: Mapping[str, torch.Tensor] | None = None) -> list[list[torch.Tensor]]:
        """Per stack: its table then its slots in the fused op's order (of ``buffers``, default now's)."""
        b = buffers if buffers is not None else self.buffers_now()
        return [[b[f"table_{i}"], *(b[f"{s}_{i}"] for s in st.optimizer.slot_names)]
                for i, st in enumerate(self.plan.stacks)]

    def load(self, weights: Mapping[str, torch.Tensor], slots: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Every stack's table and slots from per-table host tensors, read one table at a time
        (``weights`` and ``slots`` may make them on access), built on the device in place
        (:func:`~sparsecore.stacked_arrays.stacked_array`); an existing buffer keeps its
        tensor and takes the new value."""
        for i, st in enumerate(self.plan.stacks):
            self._install(i, "table", st, lambda table: weights[table], row_slot=False)
            for slot in st.optimizer.slot_names:
                self._install(i, slot, st, lambda table: slots[table][slot], slot in st.optimizer.row_slots)

    def _install(self, i: int, name: str, stack: StackedTable, values_of: Callable[[str], torch.Tensor],
                 row_slot: bool) -> None:
        """Buffer ``<name>_<i>`` built from ``values_of``; an existing one refilled in place."""
        current = getattr(self, f"{name}_{i}")
        if current is None:
            setattr(self, f"{name}_{i}", torch_tpu.from_jax(stacked_array(stack, values_of, row_slot)))
        else:
            write(current, stacked_array(stack, values_of, row_slot, into=torch_tpu.to_jax(current)))

    # -- lookup -----------------------------------------------------------------------------------

    def activations(self, csr: Sequence[torch.Tensor], buffers: Mapping[str, torch.Tensor] | None = None,
                    touched: Sequence[torch.Tensor] = ()) -> torch.Tensor | list[torch.Tensor]:
        """Every feature's pooled activations from the stacks' CSR buffers: [batch, sum of dims] in
        plan feature order when all features share one batch size, else a list per feature
        (``touched``: :attr:`PreparedCSR.touched` of ``csr``)."""
        b = buffers if buffers is not None else self.buffers_now()
        tables = [t[0] for t in self.step_tensors(b)]
        per_stack = []
        # one stack in the row view: its op writes the output's rows in place (no permuted copy)
        placed = self._row_view and len(tables) == 1 and "rows" in b
        for i, (st, table) in enumerate(zip(self.plan.stacks, tables)):
            with preprocessed():  # this backend's own CSR buffers: valid by construction
                act = torch.ops.tpu.sparse_dense_matmul(*csr[4 * i:4 * i + 4], table, st.total_sample_count,
                                                        *csr_limits(st, self.chunks, csr[4 * i + 1]),
                                                        touched_rows=touched[i] if touched else None,
                                                        output_rows=b["grad_rows_0"] if placed else None,
                                                        num_minibatches=csr_minibatches(st, self.chunks, csr[4 * i]))
            per_stack.append(act if self._row_view or self._identity[i] else act.index_select(0, b[f"perm_{i}"]))
        batch = self.plan.features[0].batch_size
        if self._row_view:
            rows = torch.cat(per_stack) if len(per_stack) > 1 else per_stack[0]
            return (rows.index_select(0, b["rows"]) if "rows" in b and not placed else rows).reshape(batch, -1)
        if not self.uniform:
            split = [rows.split([fp.samples for fp in st.features]) for st, rows in zip(self.plan.stacks, per_stack)]
            return [split[s][j][:, :dim] for (s, j), dim in zip(self._where, self._dims)]
        blocks = [rows.reshape(batch, -1) for rows in per_stack]
        wide = torch.cat(blocks, dim=1) if len(blocks) > 1 else blocks[0]
        return wide if self._columns is None else wide.index_select(1, b["columns"])

    def _activation_grads(self, grad: torch.Tensor | Sequence[torch.Tensor],
                          b: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Every stack's chunk-major activation gradient from the gradient of :meth:`activations`
        (where buffer ``grad_rows_<i>`` exists, the output's gradient rows, which the fused op reads
        at those rows)."""
        stacks = self.plan.stacks
        if self._row_view:
            rows = grad.reshape(-1, stacks[0].dim)
            if "rows" in b:  # the whole output gradient, read at each stack's grad_rows
                return [rows] * len(stacks)
            return list(rows.split(self._stack_rows)) if len(stacks) > 1 else [rows]
        if self.uniform:
            if self._columns == "permutation":
                grad = grad.index_select(1, b["columns_inverse"])
            elif self._columns == "subset":  # padded dims (and their gradient 0) between the columns
                grad = grad.new_zeros((grad.shape[0], self._width)).index_copy(1, b["columns"], grad)
            parts = grad.split([len(st.features) * st.dim for st in stacks], dim=1) if len(stacks) > 1 else [grad]
            rows = [part.reshape(-1, st.dim) for st, part in zip(stacks, parts)]
        else:
            blocks: list[list[Any]] = [[None] * len(st.features) for st in stacks]
            for (s, j), dim, g in zip(self._where, self._dims, grad):
                width = stacks[s].dim
                blocks[s][j] = g if dim == width else F.pad(g, (0, width - dim))
            rows = [torch.cat(stack_blocks) if len(stack_blocks) > 1 else stack_blocks[0] for stack_blocks in blocks]
        return [r if self._identity[i] else r.index_select(0, b[f"inverse_{i}"]) for i, r in enumerate(rows)]

    # -- fused update -----------------------------------------------------------------------------

    def updated(self, csr: Sequence[torch.Tensor], grad: torch.Tensor | Sequence[torch.Tensor], step: int | None,
                buffers: Mapping[str, torch.Tensor] | None = None, touched: Sequence[torch.Tensor] = (),
                ) -> list[tuple[torch.Tensor, ...]]:
        """Per stack, the new (table, *slots) after the fused update with the activations'
        ``grad`` (``step``: the update's number from 1, which Adam needs; None inside a program;
        ``touched``: :attr:`PreparedCSR.touched` of ``csr``)."""
        out = []
        for name, args, kwargs in self._update_calls(csr, grad, step, buffers, touched):
            with preprocessed():
                new = getattr(torch.ops.tpu, name)(*args, **kwargs)
            out.append(new if isinstance(new, tuple) else (new,))
        return out

    def update_in_place(self, csr: Sequence[torch.Tensor], grad: torch.Tensor | Sequence[torch.Tensor],
                        step: int, touched: Sequence[torch.Tensor] = ()) -> None:
        """:meth:`updated` stored into the buffers, each stack's update donating its table and
        slots (eagerly, no second table: :func:`~torch_tpu.ops.sparsecore_inplace.fused_update_`)."""
        for name, args, kwargs in self._update_calls(csr, grad, step, touched=touched):
            with preprocessed():
                fused_update_(name, *args, **kwargs)

    def _update_calls(self, csr: Sequence[torch.Tensor], grad: torch.Tensor | Sequence[torch.Tensor],
                      step: int | None, buffers: Mapping[str, torch.Tensor] | None = None,
                      touched: Sequence[torch.Tensor] = ()) -> list[tuple[str, tuple, dict[str, Any]]]:
        """Per stack, the fused op's name and arguments (see :meth:`updated`)."""
        b = buffers if buffers is not None else self.buffers_now()
        calls = []
        for i, (st, grad_i, current) in enumerate(zip(self.plan.stacks, self._activation_grads(grad, b),
                                                      self.step_tensors(b))):
            limits = (st.total_sample_count, *csr_limits(st, self.chunks, csr[4 * i + 1]))
            args = (*csr[4 * i:4 * i + 4], *current, grad_i.contiguous(), *self._hypers(i, st, step, b), *limits)
            calls.append((rule_of(st.optimizer).op_name, args, {
                "touched_rows": touched[i] if touched else None, "grad_rows": b.get(f"grad_rows_{i}"),
                "num_minibatches": csr_minibatches(st, self.chunks, csr[4 * i])}))
        return calls

    def _hypers(self, i: int, stack: StackedTable, step: int | None, b: Mapping[str, torch.Tensor]) -> list[Any]:
        """Stack ``i``'s fused op's hyperparameters (its optimizer rule's; the fixed tensor ones
        are buffers, the others made for ``step``)."""
        rule = rule_of(stack.optimizer)
        values = rule.op_hypers(stack.optimizer, None if rule.in_step else step)
        if rule.in_step:
            return [b[f"hyper{k}_{i}"] if tensor else value
                    for k, (value, tensor) in enumerate(zip(values, self._tensor_hypers[i]))]
        return [torch.tensor(float(value), device=DEVICE) if tensor else value
                for value, tensor in zip(values, self._tensor_hypers[i])]

    def traceable(self) -> bool:
        """Whether the update runs inside a step program (no host value per step)."""
        return all(rule_of(st.optimizer).in_step for st in self.plan.stacks)

    def lookup_with_update(self, anchor: torch.Tensor, arguments: Sequence[torch.Tensor]) -> torch.Tensor:
        """:meth:`activations` (uniform batch) of a batch's :attr:`PreparedCSR.arguments` whose
        backward applies the fused update to this module's buffers (``anchor``: a tensor requiring
        grad, so that autograd runs it)."""
        return _LookupWithUpdate.apply(anchor, self, *arguments)


class _LookupWithUpdate(torch.autograd.Function):
    """Forward: the lookup; backward: the fused update of the tensors the forward read (under a
    trace those are the program's inputs, so their new values become its outputs)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, state: StackedState, *arguments: torch.Tensor) -> torch.Tensor:
        n = len(CSR_FIELDS) * len(state.plan.stacks)
        ctx.state, ctx.csr, ctx.touched = state, arguments[:n], arguments[n:]
        ctx.buffers = state.buffers_now()
        return state.activations(ctx.csr, ctx.buffers, ctx.touched)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        tensors = ctx.state.step_tensors(ctx.buffers)
        for current, new in zip(tensors, ctx.state.updated(ctx.csr, grad, None, ctx.buffers, ctx.touched)):
            for target, value in zip(current, new):
                target.copy_(value)
        return (None, None, *(None for _ in (*ctx.csr, *ctx.touched)))


class OpsBackend(ReadsTablesAlone):
    """The stacks of ``plan`` on the tpu device, run by the ``tpu::`` SparseCore ops."""

    name = OPS

    def __init__(self, plan: StackingPlan, weights: Mapping[str, torch.Tensor] | None = None, seed: int = 0,
                 overflow: str = "error", fixed_layout: bool = False):
        super().__init__(plan)
        self.overflow = check_overflow_policy(overflow)
        if overflow == "minibatch" and plan.topology.num_devices > 1:
            raise ValueError(f"the ops backend minibatches one device's buffers; {plan.topology} has "
                             f"{plan.topology.num_devices} devices (use overflow 'error' or 'drop' there)")
        self.state = StackedState(plan, fixed_layout)
        self._fitter = CsrFitter(plan)
        self._load_initial(weights, seed)

    def _load(self, weights: Mapping[str, torch.Tensor], slots: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        self.state.load(weights, slots)

    def prepare(self, inputs: Mapping[str, FeatureInput], agree: Agree | None = None) -> PreparedCSR:
        """The CSR buffers of ``inputs``, cut to the sizes the batch needs, and (where the ops
        take it and an update follows) each stack's touched rows, found here on the host
        (:class:`~sparsecore.csr_sizes.CsrFitter`; ``agree``: see there)."""
        if self.overflow == "minibatch":
            csr, stats = self._fitter.minibatched(inputs, agree)
        else:
            batch = preprocess_inputs(inputs, self.plan, overflow=self.overflow)
            csr, stats = self._fitter.cut(batch, agree), batch.stats
        touched = self._fitter.touched(csr, agree) if torch.is_grad_enabled() and dedups_on_host() else ()
        return PreparedCSR(tuple(torch.from_numpy(a) for buffers in csr for a in buffers), stats,
                           tuple(torch.from_numpy(t) for t in touched))

    def _prepared(self, prepared: Any) -> PreparedCSR:
        return prepared if isinstance(prepared, PreparedCSR) else self.prepare(prepared)

    def count_step(self, prepared: PreparedCSR) -> None:
        """Count an update that a step program runs (its stats become the last ones)."""
        self.steps += 1
        self.last_stats = prepared.stats

    def _activations(self, inputs: Any) -> tuple[torch.Tensor | list[torch.Tensor], PreparedCSR]:
        """:meth:`StackedState.activations` of a batch (prepared here if it is not yet), on tpu."""
        prepared = self._prepared(inputs)
        self.last_stats = prepared.stats
        with torch.no_grad():
            return self.state.activations([t.to(DEVICE) for t in prepared.csr]), prepared

    def lookup(self, prepared: Any) -> tuple[torch.Tensor, PreparedCSR]:
        if not self.state.uniform:
            raise ValueError("lookup() needs one batch size for all features; use forward()")
        out, prepared = self._activations(prepared)
        return out.cpu(), prepared

    def update(self, context: PreparedCSR, grad: torch.Tensor) -> None:
        self._apply(context, grad.to(DEVICE))

    def _apply(self, context: PreparedCSR, grad: torch.Tensor | list[torch.Tensor]) -> None:
        self.steps += 1
        with torch.no_grad():
            self.state.update_in_place([t.to(DEVICE) for t in context.csr], grad, self.steps,
                                       touched=[t.to(DEVICE) for t in context.touched])

    def forward(self, inputs: Mapping[str, FeatureInput]) -> tuple[dict[str, torch.Tensor], PreparedCSR]:
        out, prepared = self._activations(inputs)
        names = [f.name for f in self.plan.features]
        if self.state.uniform:
            return dict(zip(names, out.cpu().split([self.plan.tables[f.table].dim for f in self.plan.features],
                                                   dim=1))), prepared
        return {name: a.cpu() for name, a in zip(names, out)}, prepared

    def backward(self, context: PreparedCSR, grads: Mapping[str, torch.Tensor]) -> None:
        check_grads(self.plan, grads)
        ordered = [grads[f.name].float().to(DEVICE) for f in self.plan.features]
        self._apply(context, torch.cat(ordered, dim=1) if self.state.uniform else ordered)

    def reset_rows(self, table: str, rows: torch.Tensor, weights: torch.Tensor, slots: Mapping[str, float]) -> None:
        """(Writes those rows of the stack's buffers alone, in place:
        :func:`~sparsecore.stacked_arrays.reset_table_rows`.)"""
        i, st = self.plan.stack_of_table(table)
        buffers = [getattr(self.state, f"{name}_{i}") for name in ("table", *slots)]
        new = reset_table_rows(st, table, [concrete_value(b) for b in buffers], rows.numpy(), weights.numpy(),
                               list(slots.values()))
        for buffer, value in zip(buffers, new):
            write(buffer, value)

    def table_value(self, table: str, slot: str | None = None) -> torch.Tensor:
        """(Gathers that table's rows alone.)"""
        i, st = self.plan.stack_of_table(table)
        index = 0 if slot is None else 1 + st.optimizer.slot_names.index(slot)
        return unstack_table(st, torch_tpu.to_jax(self.state.step_tensors()[i][index]), table)
