"""The sparsecore EBC's lookup and fused update as an input stage of a compiled training step
(:mod:`torch_tpu.compile.input_stage`): the dense step, the lookup that feeds it and the
embedding update that consumes its gradient run as ONE XLA program per step, as on a TPU whose
step program holds the SparseCore lookup and the TensorCore towers together.

Only a one-rank EBC fuses (with several ranks the output dist is a host collective between the
lookup and the dense step), on a backend that fuses its step (``fuses_step``: the ``xla`` family),
with every output column served exactly once (a permutation of the local activations), and a
batch the SparseCores split without padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from sparsecore.backends.xla import PreparedLookup
from torch_tpu.compile.input_stage import StageInput
from torchrec_tpu.sharding.ebc import LocalBatch, ShardedSparseCoreEBC


class PooledLookupStage:
    """``ebc``'s pooled embeddings as TorchRec's ``SparseArch`` returns them, [batch, features, dim]
    in ``feature_order``, computed inside the step program; their gradient updates the tables
    there (the same lookup and update programs the EBC runs on its own, so the same numbers)."""

    def __init__(self, ebc: ShardedSparseCoreEBC, feature_order: Sequence[str]) -> None:
        self.ebc, self.backend = ebc, ebc._backend
        dims = {f.name: ebc.tables[f.table].dim for f in ebc.features}
        if len(set(dims.values())) != 1 or sorted(feature_order) != sorted(dims):
            raise ValueError(f"a pooled [batch, features, dim] output needs one dim for all features in the EBC's "
                             f"features, got dims {dims} for order {list(feature_order)}")
        self.shape = (ebc.batch_size, len(feature_order), dims[feature_order[0]])
        # pooled column k = EBC output column wanted[k] = activation column order[wanted[k]]
        wanted = np.concatenate([np.arange(ebc._offsets[name], ebc._offsets[name] + dims[name])
                                 for name in feature_order])
        placement = ebc._placement
        order = np.arange(wanted.size) if placement.identity else placement.order.numpy()
        self.forward_columns = _unless_identity(order[wanted])
        # activation column c is output column columns[c], i.e. pooled column position[columns[c]]
        position = np.empty_like(wanted)
        position[wanted] = np.arange(wanted.size)
        self.backward_columns = _unless_identity(position[ebc._columns[0].numpy()])

    @staticmethod
    def of(ebc: torch.nn.Module, feature_order: Sequence[str]) -> PooledLookupStage | None:
        """The stage of ``ebc``, or None where its step cannot be fused (not a sparsecore EBC, or
        see the module docstring)."""
        if not (isinstance(ebc, ShardedSparseCoreEBC) and ebc._backend is not None and ebc._backend.fuses_step
                and ebc.world_size == 1 and ebc._placement.permutation and ebc._grad_scale == 1.0
                and ebc.batch_size == ebc.requested_batch_size):
            return None
        return PooledLookupStage(ebc, feature_order)

    def input(self, batch: LocalBatch) -> StageInput | None:
        """The step argument standing for ``batch``'s pooled embeddings (one fused update is
        counted), or None when ``batch`` was not prepared for this backend."""
        prepared = batch.prepared
        if not isinstance(prepared, PreparedLookup):
            return None
        self.ebc.steps += 1
        return StageInput(self, self.backend.fused_step_inputs(prepared), prepared.key)

    def state(self) -> Any:
        return self.backend.step_state()

    def set_state(self, state: Any) -> None:
        self.backend.set_step_state(state)

    def forward(self, state: Any, inputs: Any) -> Any:
        activations = self.backend.fused_lookup(state, inputs)
        if self.forward_columns is not None:
            activations = activations[:, self.forward_columns]
        return activations.reshape(self.shape)

    def backward(self, state: Any, inputs: Any, grad: Any) -> Any:
        grad = grad.reshape(self.shape[0], -1)
        if self.backward_columns is not None:
            grad = grad[:, self.backward_columns]
        return self.backend.fused_update(state, inputs, grad)


def _unless_identity(columns: np.ndarray) -> np.ndarray | None:
    return None if np.array_equal(columns, np.arange(columns.size)) else columns.astype(np.int32)

