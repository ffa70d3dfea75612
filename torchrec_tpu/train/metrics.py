"""Evaluation: mean BCE loss and ROC AUC over a held-out stream, aggregated over all ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torchmetrics.classification import BinaryAUROC
from torchrec.datasets.utils import Batch


@dataclass(frozen=True)
class EvalResult:
    auc: float
    loss: float
    samples: int  # over all ranks


# (model, batch) -> (mean loss, logits, labels) of that batch, on the host
EvalForward = Callable[[nn.Module, Batch], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def model_outputs(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``(loss, logits, labels)`` a ``DLRMTrain``-like model returns next to its loss."""
    _, outputs = model(batch)
    return outputs


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[Batch], device: torch.device,
             forward: EvalForward = model_outputs) -> EvalResult:
    """Run ``model`` (returning ``loss, (loss, logits, labels)``; or as ``forward`` runs it) in
    eval mode over ``batches``.

    torchmetrics gathers predictions from every rank of the default process group, so the AUC is
    the global one, not an average of per-rank AUCs.
    """
    was_training = model.training
    model.eval()
    auroc = BinaryAUROC().to(device)
    loss_sum = torch.zeros(2, dtype=torch.float64)  # (sum of per-sample losses, samples)
    for batch in batches:
        batch = batch.to(device)
        loss, logits, labels = forward(model, batch)
        auroc.update(torch.sigmoid(logits), labels.int())
        loss_sum += torch.tensor([loss.item() * labels.numel(), labels.numel()], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(loss_sum)
    model.train(was_training)
    samples = int(loss_sum[1].item())
    if samples == 0:
        raise ValueError("evaluation split is empty: no samples to compute AUC on")
    return EvalResult(auc=float(auroc.compute()), loss=float(loss_sum[0] / samples), samples=samples)
