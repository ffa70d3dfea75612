"""The sparsecore EBC's lookup as a module a traced training step calls itself: its forward calls
``torch.ops.tpu.sparse_dense_matmul`` on the EBC's tpu tables (``ops`` backend) and its backward
the fused ``sparse_dense_matmul_grad_with_<optimizer>``, so a step function traced whole
(``torch_tpu.compile.train_step``) runs lookup, dense step and embedding update as ONE program,
with the tables' new values among its outputs.

Only a one-rank EBC runs this way (with several ranks the output dist is a host collective between
the lookup and the dense step), on the ``ops`` backend with an optimizer that needs no host value
per step (not Adam), with every output column served exactly once, no gradient averaging and a
batch the SparseCores split without padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from torchrec_tpu.sharding.ebc import LocalBatch, ShardedSparseCoreEBC
from torchrec_tpu.sharding.ops_backend import DEVICE, OpsBackend, PreparedCSR


class PooledLookup(nn.Module):
    """``ebc``'s pooled embeddings as TorchRec's ``SparseArch`` returns them, [batch, features, dim]
    in ``feature_order``, from a batch's CSR buffers; backward through them applies the fused
    update to the EBC's tables (its backend's ``StackedState``, a submodule here). Build it with
    :meth:`of`; :meth:`step_inputs` gives its arguments for a batch (the EBC itself is not an
    attribute: a step program's cache key describes the module)."""

    def __init__(self, ebc: ShardedSparseCoreEBC, backend: OpsBackend, feature_order: Sequence[str],
                 columns: np.ndarray) -> None:
        super().__init__()
        self.state = backend.state
        dims = {f.name: ebc.tables[f.table].dim for f in ebc.features}
        if len(set(dims.values())) != 1 or sorted(feature_order) != sorted(dims):
            raise ValueError(f"a pooled [batch, features, dim] output needs one dim for all features in the EBC's "
                             f"features, got dims {dims} for order {list(feature_order)}")
        self.shape = (ebc.batch_size, len(feature_order), dims[feature_order[0]])
        self.identity = bool(np.array_equal(columns, np.arange(columns.size)))
        if not self.identity:
            self.register_buffer("columns", torch.from_numpy(columns).to(DEVICE), persistent=False)
        self._step_inputs = _StepInputs(ebc, backend)

    @staticmethod
    def of(ebc: nn.Module, feature_order: Sequence[str]) -> PooledLookup | None:
        """The lookup of ``ebc``, or None where a step cannot call it (see the module docstring)."""
        if not isinstance(ebc, ShardedSparseCoreEBC):
            return None
        backend = ebc.local_backend
        if not (isinstance(backend, OpsBackend) and backend.state.traceable() and backend.state.uniform
                and ebc.gradient_scale == 1.0 and ebc.batch_size == ebc.requested_batch_size):
            return None
        columns = ebc.activation_columns(feature_order)  # where in the activations each pooled column is
        return None if columns is None else PooledLookup(ebc, backend, feature_order, columns)

    def step_inputs(self, batch: LocalBatch) -> tuple[torch.Tensor, ...] | None:
        """The step arguments standing for ``batch``'s pooled embeddings, ``(anchor, *arguments)`` (one
        fused update is counted), or None when ``batch`` was not prepared for this backend."""
        return self._step_inputs(batch)

    def eval_inputs(self, batch: LocalBatch) -> tuple[torch.Tensor, ...] | None:
        """:meth:`pooled`'s arguments for ``batch`` (host tensors), or None when ``batch`` was not
        prepared for this backend."""
        return batch.prepared.csr if isinstance(batch.prepared, PreparedCSR) else None

    def forward(self, anchor: torch.Tensor, *arguments: Any) -> torch.Tensor:
        return self._arranged(self.state.lookup_with_update(anchor, arguments))

    def pooled(self, *csr: torch.Tensor) -> torch.Tensor:
        """The pooled embeddings of a batch's CSR buffers (:attr:`PreparedCSR.csr`, tpu tensors),
        with no update: evaluation's lookup, which a compiled program can trace."""
        return self._arranged(self.state.activations(csr))

    def _arranged(self, activations: torch.Tensor) -> torch.Tensor:
        if not self.identity:
            activations = activations.index_select(1, self.columns)
        return activations.reshape(self.shape)


class _StepInputs:
    """Counts the EBC's steps a program runs and hands out a batch's step arguments."""

    def __init__(self, ebc: ShardedSparseCoreEBC, backend: OpsBackend) -> None:
        self.ebc, self.backend = ebc, backend
        # a leaf requiring grad that the lookup takes, so that autograd runs its backward (the update)
        self.anchor = torch.zeros(1, device=DEVICE, requires_grad=True)

    def __repr__(self) -> str:  # (the step cache describes a module's attributes by repr)
        return "_StepInputs()"

    def __call__(self, batch: LocalBatch) -> tuple[torch.Tensor, ...] | None:
        prepared = batch.prepared
        if not isinstance(prepared, PreparedCSR):
            return None
        self.ebc.steps += 1
        self.backend.count_step(prepared)
        return (self.anchor, *prepared.arguments)
