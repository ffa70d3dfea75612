"""The sparsecore EBC's lookup as a module a traced training step calls itself: its forward calls
``torch.ops.tpu.sparse_dense_matmul`` on the EBC's tpu tables (``ops`` backend) and its backward
the fused ``sparse_dense_matmul_grad_with_<optimizer>``, so a step function traced whole
(``torch_tpu.compile.train_step``) runs lookup, dense step and embedding update as ONE program,
with the tables' new values among its outputs.

With several ranks (an EBC built with ``uniform_ranks``: every rank's stacks of one shape) the
output dist is in the program too: one all-to-all of the padded activations (a
``_c10d_functional`` collective, an XLA all-to-all inside an SPMD step,
``torch_tpu.compile.train_step(..., group=...)``), then the received columns added into place
(row-wise partial sums; other ranks' data-parallel replicas and pads dropped). Its backward sends
every shard the gradient of its columns (replicas too, which keeps them equal) through the
reverse all-to-all into the fused update.

Either way it needs the ``ops`` backend with an optimizer that needs no host value per step (not
Adam) and a batch the SparseCores split without padding; one rank also every output column served
exactly once and no gradient averaging.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
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
                 columns: np.ndarray | None) -> None:
        super().__init__()
        self.state = backend.state
        dims = {f.name: ebc.tables[f.table].dim for f in ebc.features}
        if len(set(dims.values())) != 1 or sorted(feature_order) != sorted(dims):
            raise ValueError(f"a pooled [batch, features, dim] output needs one dim for all features in the EBC's "
                             f"features, got dims {dims} for order {list(feature_order)}")
        self.shape = (ebc.padded_local_batch, len(feature_order), dims[feature_order[0]])
        self.exchange = None if columns is not None else _Exchange(ebc, feature_order)
        self.identity = columns is None or bool(np.array_equal(columns, np.arange(columns.size)))
        if not self.identity:
            self.register_buffer("columns", torch.from_numpy(columns).to(DEVICE), persistent=False)
        self._step_inputs = _StepInputs(ebc, backend)

    @staticmethod
    def of(ebc: nn.Module, feature_order: Sequence[str]) -> PooledLookup:
        """The lookup of ``ebc``; ValueError saying which condition (see the module docstring)
        ``ebc`` fails where a step cannot call it."""
        why = PooledLookup.unavailable(ebc)
        if why:
            raise ValueError(f"the embedding lookup cannot run inside the step program: {why}")
        assert isinstance(ebc, ShardedSparseCoreEBC) and isinstance(ebc.local_backend, OpsBackend)
        if ebc.world_size > 1:
            return PooledLookup(ebc, ebc.local_backend, feature_order, None)
        columns = ebc.activation_columns(feature_order)  # where in the activations each pooled column is
        if columns is None:
            raise ValueError("the embedding lookup cannot run inside the step program: the one rank's "
                             "activations do not hold every output column exactly once")
        return PooledLookup(ebc, ebc.local_backend, feature_order, columns)

    @staticmethod
    def unavailable(ebc: nn.Module) -> str:
        """Why a step program cannot call ``ebc``'s lookup, or "" (the column check of one rank's
        feature order aside: :meth:`of`)."""
        if not isinstance(ebc, ShardedSparseCoreEBC):
            return f"{type(ebc).__name__} is not a ShardedSparseCoreEBC"
        backend = ebc.local_backend
        if not isinstance(backend, OpsBackend):
            return f"its backend is {type(backend).__name__}, not the ops backend"
        if not backend.state.traceable():
            return "its optimizer reads a host value every step"
        if not backend.state.uniform:
            return "its features have several batch sizes"
        if ebc.padded_local_batch != ebc.local_batch:
            return (f"its per-rank batch of {ebc.local_batch} is padded to {ebc.padded_local_batch} for the "
                    f"SparseCores' split")
        if ebc.world_size > 1 and not ebc.uniform_ranks:
            return "its ranks' stacks are not padded to one shape (uniform_ranks)"
        if ebc.world_size == 1 and ebc.gradient_scale != 1.0:
            return f"its one rank scales the gradient by {ebc.gradient_scale}"
        return ""

    def step_inputs(self, batch: LocalBatch) -> tuple[torch.Tensor, ...] | None:
        """The step arguments standing for ``batch``'s pooled embeddings, ``(anchor, *arguments)`` (one
        fused update is counted), or None when ``batch`` was not prepared for this backend."""
        return self._step_inputs(batch)

    def eval_inputs(self, batch: LocalBatch) -> tuple[torch.Tensor, ...] | None:
        """:meth:`pooled`'s arguments for ``batch`` (host tensors), or None when ``batch`` was not
        prepared for this backend."""
        return batch.prepared.csr if isinstance(batch.prepared, PreparedCSR) else None

    def forward(self, anchor: torch.Tensor, *arguments: Any) -> torch.Tensor:
        activations = self.state.lookup_with_update(anchor, arguments)
        if self.exchange is not None:
            return self.exchange(activations).reshape(self.shape)
        return self._arranged(activations)

    def pooled(self, *csr: torch.Tensor) -> torch.Tensor:
        """The pooled embeddings of a batch's CSR buffers (:attr:`PreparedCSR.csr`, tpu tensors),
        with no update: evaluation's lookup, which a compiled program can trace."""
        return self._arranged(self.state.activations(csr))

    def _arranged(self, activations: torch.Tensor) -> torch.Tensor:
        if not self.identity:
            activations = activations.index_select(1, self.columns)
        return activations.reshape(self.shape)


class _Exchange(nn.Module):
    """The output dist of every rank's padded activations ([ranks * batch, width], rows by
    destination rank) inside a traced step, into this rank's pooled [batch, columns in the
    feature order] (:meth:`ShardedSparseCoreEBC.exchange_columns`); backward scales the gradient
    by the EBC's ``gradient_scale``."""

    def __init__(self, ebc: ShardedSparseCoreEBC, feature_order: Sequence[str]) -> None:
        super().__init__()
        targets, sources, self.width = ebc.exchange_columns(feature_order)  # type: ignore[misc]
        self.ranks, self.batch, self.scale = ebc.world_size, ebc.padded_local_batch, ebc.gradient_scale
        self.columns = len(feature_order) * ebc.tables[ebc.features[0].table].dim
        self.group_name = (ebc.group or dist.group.WORLD).group_name
        self.register_buffer("gathers", torch.from_numpy(_as_gathers(targets, self.columns)).to(DEVICE),
                             persistent=False)
        self.register_buffer("sources", torch.from_numpy(sources).to(DEVICE), persistent=False)

    def forward(self, activations: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as fc

        received = fc.all_to_all_single_autograd(activations, None, None, self.group_name)
        wide = received.view(self.ranks, self.batch, self.width).permute(1, 0, 2).reshape(self.batch, -1)
        return _Placed.apply(wide, self.gathers, self.sources, self.scale)


def _as_gathers(targets: np.ndarray, columns: int) -> np.ndarray:
    """``[K, columns]`` indices into the received columns (and one zero column after them) whose K
    gathers, added, place the received columns as ``targets`` says (K: the most received columns
    one output column sums, e.g. its row-wise shards): gathers, unlike a scatter-add, run at
    memory speed on every backend."""
    kept = np.flatnonzero(targets < columns)
    order = kept[np.argsort(targets[kept], kind="stable")]
    counts = np.bincount(targets[kept], minlength=columns)
    gathers = np.full((max(1, int(counts.max(initial=0))), columns), targets.size)  # the zero column
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank_in_column = np.arange(order.size) - np.repeat(starts, counts)
    gathers[rank_in_column, targets[order]] = order
    return gathers


class _Placed(torch.autograd.Function):
    """Forward: the sum over ``gathers``' rows of the received columns they index (the index after
    the last: zeros); backward: each received column gets output column ``sources``' gradient
    (``sources`` = the output width: none) times ``scale``."""

    @staticmethod
    def forward(ctx: Any, wide: torch.Tensor, gathers: torch.Tensor, sources: torch.Tensor,
                scale: float) -> torch.Tensor:
        ctx.save_for_backward(sources)
        ctx.scale = scale
        extended = torch.cat([wide, wide.new_zeros(wide.shape[0], 1)], dim=1)
        out = extended.index_select(1, gathers[0])
        for k in range(1, gathers.shape[0]):
            out = out + extended.index_select(1, gathers[k])
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (sources,) = ctx.saved_tensors
        extended = torch.cat([grad, grad.new_zeros(grad.shape[0], 1)], dim=1)
        wide_grad = extended.index_select(1, sources)
        return (wide_grad * ctx.scale if ctx.scale != 1.0 else wide_grad), None, None, None


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
