"""``fbgemm`` backend: FBGEMM's table-batched embedding (TBE) CPU kernels, the fast host path.

One TBE holds every logical table (FBGEMM's own layout, no SparseCore stacking). Combiners are
folded into per-id weights exactly as for the SparseCores, and pooling is a weighted sum, so
results match the other backends. FBGEMM's CPU TBE fuses SGD, Adagrad and row-wise Adagrad
into its backward; Adam and FTRL have no CPU kernel there (use the ``xla`` backend). TBE rows
are padded to a multiple of 4 floats (an FBGEMM requirement); row-wise Adagrad would average
g^2 over that padded width, so it needs dims that are multiples of 4.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    EmbeddingLocation,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from sparsecore import optimizers as opt
from sparsecore.backends import FBGEMM
from sparsecore.backends.base import Backend, check_grads
from sparsecore.optimizer_rules import rule_of
from sparsecore.preprocess import combined_gains
from sparsecore.stacking import StackingPlan
from sparsecore.validation import FeatureInput

TBE_ALIGN = 4  # FBGEMM TBE rows are a multiple of 4 floats


def _tbe_optimizer(spec: opt.OptimizerSpec) -> tuple[EmbOptimType, float]:
    tbe = rule_of(spec).tbe
    if tbe is None:
        raise ValueError(
            f"FBGEMM's CPU TBE has no fused {spec.name} kernel; use the xla backend for {type(spec).__name__}"
        )
    kind, eps = tbe(spec)
    return EmbOptimType[kind], eps


class FbgemmBackend(Backend):
    """All tables in one FBGEMM TBE with the plan's (single) optimizer fused into backward."""

    name = FBGEMM

    def __init__(self, plan: StackingPlan, weights: Mapping[str, torch.Tensor] | None = None, seed: int = 0):
        super().__init__(plan)
        optimizers = {spec.optimizer for spec in plan.tables.values()}
        if len(optimizers) != 1:
            raise ValueError(f"the fbgemm backend runs one optimizer for all tables, got {len(optimizers)} different")
        self.optimizer = optimizers.pop()
        optim_type, eps = _tbe_optimizer(self.optimizer)
        # FBGEMM's CPU kernels update a table once per TBE feature, so features sharing a table
        # become one TBE feature with their bags concatenated (other tables get empty bags):
        # every touched row is then updated exactly once.
        self._features_of = {n: [f for f in plan.features if f.table == n] for n in plan.tables}
        self._bags = max(sum(f.batch_size for f in fs) for fs in self._features_of.values())
        self._table_names = list(plan.tables)
        self._dims = [plan.tables[n].dim for n in self._table_names]
        padded = [-(-d // TBE_ALIGN) * TBE_ALIGN for d in self._dims]
        if self.optimizer.row_slots and padded != self._dims:  # (its row slot averages over the padded dim)
            odd = [n for n, d in zip(self._table_names, self._dims) if d % TBE_ALIGN]
            raise ValueError(f"row-wise Adagrad on the fbgemm backend needs dims that are multiples of "
                             f"{TBE_ALIGN}; tables {odd} are not (use the xla backend)")
        self._blocks: dict[str, tuple[slice, slice]] = {}  # feature -> its block of the TBE output
        col = 0
        for name, width in zip(self._table_names, padded):
            row = 0
            for f in self._features_of[name]:
                self._blocks[f.name] = (slice(row, row + f.batch_size), slice(col, col + plan.tables[name].dim))
                row += f.batch_size
            col += width
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(plan.tables[n].vocab_size, p, EmbeddingLocation.HOST, ComputeDevice.CPU)
             for n, p in zip(self._table_names, padded)],
            optimizer=optim_type, learning_rate=self.optimizer.learning_rate, eps=eps, weight_decay=0.0,
            pooling_mode=PoolingMode.SUM,
        )
        self._load_initial(weights, seed)

    def _load(self, weights: Mapping[str, torch.Tensor], slots: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, w, d in zip(self._table_names, self.tbe.split_embedding_weights(), self._dims):
                w.zero_()
                w[:, :d] = weights[name]
            for name, states, d in zip(self._table_names, self.tbe.split_optimizer_states(), self._dims):
                for slot, state in zip(self.optimizer.slot_names, states):
                    state.fill_(self.optimizer.slot_initial_values()[slot])  # padding columns too
                    if state.dim() == 1:
                        state.copy_(slots[name][slot])
                    else:
                        state[:, :d] = slots[name][slot]

    def forward(self, inputs: Mapping[str, FeatureInput]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        ids, lengths, gains = [], [], []
        for name in self._table_names:
            features = self._features_of[name]
            for f in features:
                x = inputs[f.name]
                ids.append(x.ids)
                lengths.append(x.lengths)
                sample = np.repeat(np.arange(x.lengths.size), x.lengths)
                gains.append(combined_gains(x.weights, x.lengths, sample, self.plan.tables[name].combiner))
            lengths.append(np.zeros(self._bags - sum(f.batch_size for f in features), dtype=np.int64))
        offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))])
        with torch.enable_grad():
            pooled = self.tbe(torch.from_numpy(np.concatenate(ids)), torch.from_numpy(offsets),
                              per_sample_weights=torch.from_numpy(np.concatenate(gains)))
        out = {}
        for f, (rows, cols) in self._blocks.items():
            out[f] = pooled.detach()[rows, cols].clone()
        return out, pooled

    def backward(self, context: torch.Tensor, grads: Mapping[str, torch.Tensor]) -> None:
        check_grads(self.plan, grads)
        self.steps += 1
        full = torch.zeros_like(context)
        for f, (rows, cols) in self._blocks.items():
            full[rows, cols] = grads[f]
        context.backward(full)

    def table_weights(self) -> dict[str, torch.Tensor]:
        return {n: w.detach()[:, :d].clone()
                for n, w, d in zip(self._table_names, self.tbe.split_embedding_weights(), self._dims)}

    def optimizer_slots(self) -> dict[str, dict[str, torch.Tensor]]:
        return {
            name: {slot: (s if s.dim() == 1 else s[:, :d]).detach().clone()
                   for slot, s in zip(self.optimizer.slot_names, states)}
            for name, states, d in zip(self._table_names, self.tbe.split_optimizer_states(), self._dims)
        }
