"""Evaluation: mean BCE loss, ROC AUC, normalized entropy and accuracy (at probability 0.5) over a
held-out stream, aggregated over all ranks.

Ranks evaluate in lock-step: every batch can be zero-padded to one size (``batch_rows``), a rank
with no rows left evaluating empty batches so padded, and the padding rows are masked out of the
metrics, so every held-out row is scored once at any world size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def normalized_entropy(mean_loss: float, base_rate: float) -> float:
    """NE (He et al., 2014; ``torchrec.metrics.ne``): the mean log loss over the entropy of the base
    rate ``p`` (the mean label), ``-(p ln p + (1 - p) ln(1 - p))``; 1.0 for a model that predicts
    ``p`` everywhere. NaN when every label is the same (the entropy is 0)."""
    entropy = -sum(q * math.log(q) for q in (base_rate, 1.0 - base_rate) if q > 0)
    return mean_loss / entropy if entropy > 0 else float("nan")


@dataclass(frozen=True)
class EvalResult:
    auc: float
    loss: float
    samples: int  # over all ranks
    accuracy: float = float("nan")  # predictions at probability >= 0.5 that match the label
    ne: float = float("nan")  # normalized entropy (:func:`normalized_entropy`)

    def describe(self) -> str:
        """``AUC 0.8421, NE 0.8812, loss 0.4312, accuracy 0.80``."""
        return f"AUC {self.auc:.4f}, NE {self.ne:.4f}, loss {self.loss:.4f}, accuracy {self.accuracy:.2f}"

    def scalars(self, split: str) -> dict[str, float]:
        """The TensorBoard scalars of ``split``: ``<split>/auc``, ``/ne``, ``/loss``, ``/accuracy``."""
        return {f"{split}/auc": self.auc, f"{split}/ne": self.ne, f"{split}/loss": self.loss,
                f"{split}/accuracy": self.accuracy}


# (model, batch) -> the batch's logits [B], on the host
EvalForward = Callable[[nn.Module, Batch], torch.Tensor]
# (model, a split's batches, progress=(rows, batches) -> None or None) -> the split's evaluation (a model's own
# metrics: AUC, NE, loss, samples, describe() and scalars(split), as EvalResult has them)
Evaluator = Callable[..., EvalResult]


def model_outputs(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The logits a ``DLRMTrain``-like model returns next to its loss."""
    _, (_, logits, _) = model(batch)
    return logits


def padded(batch: Batch, rows: int) -> Batch:
    """``batch`` with rows appended up to ``rows``: dense features 0, empty bags, label 0."""
    extra = rows - batch.labels.numel()
    if extra <= 0:
        return batch
    kjt = batch.sparse_features
    lengths = kjt.lengths().view(len(kjt.keys()), -1)
    sparse = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(),
                               lengths=functional.pad(lengths, (0, extra)).flatten())
    return Batch(dense_features=functional.pad(batch.dense_features, (0, 0, 0, extra)),
                 sparse_features=sparse, labels=functional.pad(batch.labels, (0, extra)))


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[Batch], device: torch.device,
             forward: EvalForward = model_outputs, batch_rows: int = 0,
             progress: Callable[[int, int], None] | None = None) -> EvalResult:
    """Run ``model`` (returning ``loss, (loss, logits, labels)``; or as ``forward`` runs it) in
    eval mode over ``batches``, each zero-padded to ``batch_rows`` rows (0: as they come) and
    scored on its own rows only; ``progress(rows, batches)`` hears the count scored after each batch.

    torchmetrics gathers predictions from every rank of the default process group, so the AUC is
    the global one, not an average of per-rank AUCs.
    """
    was_training = model.training
    model.eval()
    auroc = BinaryAUROC().to(device)
    accuracy = BinaryAccuracy().to(device)
    loss_sum = torch.zeros(3, dtype=torch.float64)  # (sum of per-sample losses, samples, sum of labels)
    for index, batch in enumerate(batches):
        rows = batch.labels.numel()
        batch = padded(batch, batch_rows).to(device)
        logits, labels = forward(model, batch)[:rows], batch.labels[:rows]
        if rows:  # (BinaryAccuracy cannot reshape an empty batch; a rank's last batch may be one)
            auroc.update(torch.sigmoid(logits), labels.int())
            accuracy.update(torch.sigmoid(logits), labels.int())
        loss = functional.binary_cross_entropy_with_logits(logits, labels.float(), reduction="sum")
        loss_sum += torch.tensor([loss.item(), rows, labels.double().sum().item()], dtype=torch.float64)
        if progress is not None:
            progress(int(loss_sum[1]), index + 1)
    if dist.is_initialized():
        dist.all_reduce(loss_sum)
    model.train(was_training)
    samples = int(loss_sum[1].item())
    if samples == 0:
        raise ValueError("evaluation split is empty: no samples to compute AUC on")
    loss = float(loss_sum[0] / samples)
    return EvalResult(auc=float(auroc.compute()), loss=loss, samples=samples, accuracy=float(accuracy.compute()),
                      ne=normalized_entropy(loss, float(loss_sum[2] / samples)))
