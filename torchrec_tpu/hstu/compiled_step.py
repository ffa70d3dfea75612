"""HSTU's dense half as one compiled tpu program per step, as DLRM's towers run
(:mod:`torchrec_tpu.train.engines.dense_step`).

:class:`HSTUDenseLoss` is the model's STU stack and heads with the training loss, from the
stack's input (the tokens the tables looked up, their jagged layout, the candidates' rows) and the
labels; it shares the model's own parameter objects, so the optimizer, checkpoints and evaluation
see one model. :class:`CompiledHSTUStep` runs it with the dense optimizer's update as one program
(``torch_tpu.compile.train_step``, the attention by the jagged op inside it); the tokens' gradient
goes back into the tables' own update (the sharded EC's fused one, or stock TorchRec's optimizer).
One program serves every batch of the same padded shapes: rows, users, candidates and length
bucket (``dlrmv3``'s N is an input).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torchrec.optim.keyed import KeyedOptimizer

from pipelines.sequences.reader import SequenceBatch
from torchrec_tpu.hstu.layers import Sequences
from torchrec_tpu.hstu.model import HSTU
from torchrec_tpu.train.engines.precision import autocast
from torchrec_tpu.train.engines.step_layout import StepLayout

_log = logging.getLogger(__name__)


class HSTUDenseLoss(nn.Module):
    """``(x, offsets, timestamps, num_targets, candidates, labels, longest, max_len) -> loss`` of
    ``model``'s STU stack and heads, traced into a step program: the forward at ``precision``
    (``--precision``), the loss of :func:`torchrec_tpu.hstu.train.loss`."""

    def __init__(self, model: HSTU, precision: str = "fp32") -> None:
        super().__init__()
        self.stack, self.heads, self.precision = model.stack, model.heads, precision

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor, num_targets: torch.Tensor,
                candidates: torch.Tensor, labels: torch.Tensor, longest: torch.Tensor, max_len: int) -> torch.Tensor:
        from torchrec_tpu.hstu.train import loss

        seq = Sequences(offsets, timestamps, num_targets, max_len, longest, in_program=True)
        with autocast("tpu", self.precision):
            logits = self.heads(self.stack(x, seq)[candidates])
        return loss(logits, labels)


class CompiledHSTUStep:
    """A training step of ``model`` (its stack and heads on tpu) for ``layout`` (one program per
    rank): the tables' lookup on the host, the stack, heads, loss, backward and ``adam``'s update as
    one program, then the tables' update from the tokens' gradient (``sparse_opt``: stock
    TorchRec's tables' optimizer; None: the sharded EC updates itself in backward). One rank."""

    def __init__(self, model: HSTU, adam: KeyedOptimizer, sparse_opt: KeyedOptimizer | None,
                 layout: StepLayout) -> None:
        import torch_tpu.compile as tc

        if layout.world_size != 1:
            raise ValueError(f"CompiledHSTUStep runs one rank's step; the layout has {layout.world_size} ranks")
        self.model, self.sparse_opt = model, sparse_opt
        inner = getattr(adam, "_optimizer", adam)  # KeyedOptimizerWrapper steps its inner one
        self.step = tc.train_step(HSTUDenseLoss(model, layout.precision), inner, input_grads=(0,))
        _log.info("training step: the STU stack, heads and dense optimizer as one compiled program; the tables' "
                  "lookup and update outside it")

    def __call__(self, batch: SequenceBatch) -> torch.Tensor:
        x, seq, candidates = self.model.stack_inputs(batch.features, in_program=True)
        loss, (x_grad,) = self.step(x.detach(), seq.offsets, seq.timestamps, seq.num_targets, candidates,
                                    batch.labels, seq.longest, seq.max_len)
        if self.sparse_opt is not None:
            self.sparse_opt.zero_grad()
        # into the tables' update; on this thread (autograd's device threads lack the tpu device when
        # a CPU backward ran before torch_tpu was imported)
        with torch.autograd.set_multithreading_enabled(False):
            x.backward(x_grad.cpu())
        if self.sparse_opt is not None:
            self.sparse_opt.step()
        return loss
