"""The dense half of the sparsecore training step as one compiled tpu program.

:class:`DLRMDenseLoss` is a TorchRec ``DLRMTrain`` without its sparse arch: bottom MLP,
interaction (dot or DCN), over arch and the BCE loss, from (dense features, pooled embeddings,
labels). It shares the DLRM's own parameter objects, so the optimizer, checkpoints and
evaluation see one model. :class:`CompiledDenseStep` runs it with the dense optimizer's update as
one program (``torch_tpu.compile.train_step``); a batch whose input dist ran ahead (the
prefetch pipeline) for an EBC on the ``ops`` backend also has its embedding lookup and fused
sparse update inside that program: the traced step calls the ``tpu::`` SparseCore ops itself
(:class:`DLRMLookupLoss`, :mod:`torchrec_tpu.sharding.step_lookup`); else the pooled embeddings'
gradient goes back into the sparsecore EBC's own fused update. :func:`eval_forward` runs evaluation's towers as one
compiled program too.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRMTrain

from torchrec_tpu.sharding.batching import fixed_size_chunks
from torchrec_tpu.sharding.ebc import PrefetchedKJT
from torchrec_tpu.train.engines.dense_placement import pooled_on_host
from torchrec_tpu.train.engines.precision import autocast, eager_eval_forward, eager_train_step
from torchrec_tpu.train.engines.step_layout import StepLayout
from torchrec_tpu.train.loop import StepFn
from torchrec_tpu.train.metrics import EvalForward

_log = logging.getLogger(__name__)


class DLRMDenseLoss(nn.Module):
    """``(dense_features [B, dense_in], pooled [B, F, D], labels [B]) -> loss`` of ``train_model``,
    the towers' forward at ``precision`` (``--precision``) on their device."""

    def __init__(self, train_model: DLRMTrain, precision: str = "fp32") -> None:
        super().__init__()
        self.precision = precision
        dlrm = train_model.model
        self.dense_arch = dlrm.dense_arch
        self.inter_arch = dlrm.inter_arch
        self.over_arch = dlrm.over_arch
        self.loss_fn = train_model.loss_fn

    def forward(self, dense_features: torch.Tensor, pooled: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.logits(dense_features, pooled), labels.float())

    def logits(self, dense_features: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """``[B]`` logits (float32)."""
        with autocast(dense_features.device.type, self.precision):
            embedded = self.dense_arch(dense_features)
            logits = self.over_arch(self.inter_arch(dense_features=embedded, sparse_features=pooled)).squeeze(-1)
        return logits.float()


class DLRMLookupLoss(nn.Module):
    """``(dense_features, labels, anchor, *arguments) -> loss``: the embedding lookup (``lookup``, a
    :class:`~torchrec_tpu.sharding.step_lookup.PooledLookup`, whose backward updates the tables)
    feeding ``dense``."""

    def __init__(self, dense: DLRMDenseLoss, lookup: nn.Module) -> None:
        super().__init__()
        self.dense, self.lookup = dense, lookup

    def forward(self, dense_features: torch.Tensor, labels: torch.Tensor, anchor: torch.Tensor,
                *arguments: torch.Tensor) -> torch.Tensor:
        return self.dense(dense_features, self.lookup(anchor, *arguments), labels)


class CompiledDenseStep:
    """A ``run_training`` step function for ``layout`` (one program per rank). Where the layout
    runs the lookup inside (``lookup_in_step``), a full batch, its input dist prefetched or run
    first: lookup, output dist, dense step and sparse update as one tpu program per rank. Else, and
    for a short batch (an epoch's last on one rank): the sparse arch (host, sparsecore EBC)
    forward, the dense step as one tpu program, then the EBC's fused backward from the pooled
    embeddings' gradient.

    ``model`` is the sparsecore engine's ``DLRMTrain`` (DDP-wrapped or not) with its towers on tpu
    (:func:`~torchrec_tpu.train.engines.dense_placement.place_dense`); ``optimizer`` the dense optimizer
    (a ``KeyedOptimizerWrapper`` or a plain torch optimizer) over the towers' parameters; several
    ranks: each program is SPMD over the world, the towers' gradients averaged inside (as DDP)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, layout: StepLayout) -> None:
        import torch_tpu.compile as tc
        from torchrec_tpu.sharding.step_lookup import PooledLookup  # imports torch_tpu

        group = dist.group.WORLD if layout.world_size > 1 else None
        self.model: DLRMTrain = getattr(model, "module", model)
        self.dense = DLRMDenseLoss(self.model, layout.precision)
        inner = getattr(optimizer, "_optimizer", optimizer)  # KeyedOptimizerWrapper steps its inner one
        self.step = tc.train_step(self.dense, inner, input_grads=(1,), group=group)
        sparse_arch = self.model.model.sparse_arch
        self.ebc = sparse_arch.embedding_bag_collection
        self.lookup = PooledLookup.of(self.ebc, sparse_arch.sparse_feature_names) if layout.lookup_in_step else None
        self.fused_step = None if self.lookup is None else tc.train_step(DLRMLookupLoss(self.dense, self.lookup),
                                                                           inner, input_grads=(2,), group=group)
        ranks = "" if group is None else f" per rank (SPMD over {layout.world_size} ranks)"
        self.program_name = (f"one compiled program{ranks}: embedding lookup, "
                             f"{'all-to-alls, ' if group is not None else ''}towers, dense update and fused "
                             "embedding update" if self.fused_step is not None else
                             f"the towers and dense update as one compiled program{ranks}; the embedding lookup "
                             "and update outside it")
        _log.info("training step: %s%s", self.program_name,
                  "" if self.fused_step is not None else f" ({layout.lookup_outside})")
        self.short_batches = 0  # batches shorter than the EBC's, whose lookup ran outside the program

    def __call__(self, model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> torch.Tensor:
        kjt = batch.sparse_features
        if self.fused_step is not None and kjt.stride() == self.ebc.padded_local_batch:
            if not isinstance(kjt, PrefetchedKJT):
                kjt = self.ebc.prefetch(kjt)  # no prefetch thread (the profiler's run): the input dist here
            if kjt.owner is self.ebc:  # type: ignore[union-attr]
                self.ebc.settle_collisions(kjt.local)  # type: ignore[union-attr]
            inputs = self.lookup.step_inputs(kjt.local) if kjt.owner is self.ebc else None  # type: ignore[union-attr]
            if inputs is None:
                raise ValueError("the training layout runs the embedding lookup inside the step program, but this "
                                 "batch's input dist was not prepared for the ops backend by this model's EBC")
            loss, _ = self.fused_step(batch.dense_features, batch.labels, *inputs)
            return loss
        if self.fused_step is not None and not self.short_batches:
            _log.info("a batch of %d samples per rank, shorter than the step program's %d (an epoch's last): "
                      "its embedding lookup and update run outside the program", kjt.stride(),
                      self.ebc.padded_local_batch)
        self.short_batches += self.fused_step is not None
        # the host tensors go into the program as they are (one copy each, no eager tpu ops)
        pooled = _host_pooled(self.model, batch)
        loss, (pooled_grad,) = self.step(batch.dense_features, pooled.detach(), batch.labels)
        # into the fused sparse update; on this thread (autograd's device threads lack the tpu
        # device when a CPU backward ran before torch_tpu was imported)
        with torch.autograd.set_multithreading_enabled(False):
            pooled.backward(pooled_grad.cpu())
        return loss


class CompiledDenseEval:
    """An ``evaluate`` forward of the sparsecore DLRM with its towers on tpu, as one program
    (``torch.compile``, backend ``tpu``) instead of one dispatch, and a first-sight compile, per
    op. Where ``layout`` runs the lookup inside the step on one rank, the program looks the
    embeddings up too, from the batch's CSR buffers
    (:meth:`~torchrec_tpu.sharding.step_lookup.PooledLookup.pooled`), in chunks of the EBC's batch
    size (the last zero-padded); otherwise (e.g. several ranks, whose output dist runs on the host)
    the sparse arch runs on the host first and a batch smaller than the largest so far (an
    evaluation split's last) is zero-padded to it. Either way one program serves the whole split.
    ``model``: DDP-wrapped or not."""

    def __init__(self, model: nn.Module, layout: StepLayout) -> None:
        import torch_tpu.compile  # noqa: F401  (registers the "tpu" backend)
        from torchrec_tpu.sharding.step_lookup import PooledLookup  # imports torch_tpu

        self.model: DLRMTrain = getattr(model, "module", model)
        self.device = layout.dense_device
        self.dense = DLRMDenseLoss(self.model, layout.precision)
        self.logits = torch.compile(self.dense.logits, backend="tpu", dynamic=False)
        self.rows = 0
        sparse_arch = self.model.model.sparse_arch
        self.ebc = sparse_arch.embedding_bag_collection
        in_program = layout.lookup_in_step and layout.world_size == 1
        self.lookup = PooledLookup.of(self.ebc, sparse_arch.sparse_feature_names) if in_program else None
        self.lookup_logits = None if self.lookup is None else torch.compile(self._lookup_logits, backend="tpu",
                                                                            dynamic=False)
        self.one_program_batches = 0  # batches evaluated with the lookup inside the program

    def _lookup_logits(self, dense_features: torch.Tensor, *csr: torch.Tensor) -> torch.Tensor:
        pooled = self.lookup.pooled(*(t.to(self.device) for t in csr))  # type: ignore[union-attr]
        return self.dense.logits(dense_features.to(self.device), pooled)

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        from torch_tpu.compile.dynamo.buckets import pad_dim

        if self.lookup_logits is not None:
            self.one_program_batches += 1
            return self._looked_up(batch)
        rows = batch.labels.shape[0]
        pooled = _host_pooled(self.model, batch)
        self.rows = max(self.rows, rows)
        return self.logits(pad_dim(batch.dense_features, 0, self.rows).to(self.device),
                           pad_dim(pooled, 0, self.rows).to(self.device)).cpu()[:rows]

    def _looked_up(self, batch: Batch) -> torch.Tensor:
        """``batch``'s logits, each chunk of the EBC's batch size (the last zero-padded) one run of
        the lookup-and-towers program."""
        from torch_tpu.compile.dynamo.buckets import pad_dim

        size, parts, first = self.ebc.padded_local_batch, [], 0
        for chunk, real in fixed_size_chunks(batch.sparse_features, size):
            csr = self.lookup.eval_inputs(self.ebc.input_dist(chunk, training=False))  # type: ignore[union-attr]
            if csr is None:
                raise ValueError("the training layout runs the embedding lookup inside the evaluation program, but "
                                 "this batch's input dist prepared no CSR buffers for the ops backend")
            dense = pad_dim(batch.dense_features[first:first + real], 0, size)
            parts.append(self.lookup_logits(dense, *csr).cpu()[:real])  # type: ignore[misc]
            first += real
        return torch.cat(parts) if len(parts) > 1 else parts[0]


def _host_pooled(model: DLRMTrain, batch: Batch) -> torch.Tensor:
    """The sparse arch's pooled embeddings of ``batch``, left on the host (the sparsecore EBC)."""
    with pooled_on_host():
        return model.model.sparse_arch(batch.sparse_features)


def step_function(model: nn.Module, optimizer: torch.optim.Optimizer, layout: StepLayout) -> StepFn:
    """The sparsecore engine's training step, the towers' forward at ``layout.precision``: the
    compiled dense step where ``layout`` is one program per rank; else the eager
    :func:`~torchrec_tpu.train.loop.train_step`."""
    if layout.one_program:
        return CompiledDenseStep(model, optimizer, layout)
    if layout.dense_device.type == "tpu":
        why = ("FSDP2's DTensor parameters do not trace into one step program; ddp's do"
               if layout.dense_parallel != "ddp"
               else "the ranks do not run the tpu_dist XLA transport, which one SPMD step program needs")
        _log.info("training step: eager on tpu, one program per op (%s)", why)
    return eager_train_step(layout.dense_device.type, layout.precision)


def eval_forward(model: nn.Module, layout: StepLayout) -> EvalForward:
    """The evaluation forward of a job, the towers at ``layout.precision`` as in training:
    compiled towers where the step is compiled; else the model's own forward."""
    if layout.one_program:
        return CompiledDenseEval(model, layout)
    return eager_eval_forward(layout.dense_device.type, layout.precision)
