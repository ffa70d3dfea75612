"""The divergence guard: training stops when a step's loss is not finite (NaN, inf) or has grown
:data:`GROWTH` times over the run's first step's, in one line naming the step, the loss and the
learning rates (SGD at a rate meant for Adagrad blows up within a few steps, and AUC 0.5 at the
end would say nothing).

The guard sees the losses where the loop reads them anyway (every ``--log-every`` steps, before a
checkpoint, at the end): it adds no device sync. Over several ranks every rank checks at the same
steps and they agree by one all_reduce of one int64, so all of them stop together with the first
flagged rank's line.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist

from torchrec_tpu.rank_watch import collectives

GROWTH = 100.0  # two orders of magnitude over the first step's loss


class TrainingDiverged(FloatingPointError):
    """The training loss is not finite or exploded; the message names the step, loss and learning rates."""


def _text(loss: float) -> str:
    return "NaN" if loss != loss else f"{loss:.4g}"


class DivergenceGuard:
    """Checks the step losses of one rank (``world_size`` ranks check at the same steps);
    ``rates`` describes the learning rates for the message (``--sparse-lr 5.0 (sgd), ...``)."""

    def __init__(self, rates: str = "", world_size: int = 1, growth: float = GROWTH) -> None:
        self.rates, self.world_size, self.growth = rates, world_size, growth
        self.first: float | None = None  # the run's first step's loss

    def check(self, losses: Iterable[tuple[int, int, float]]) -> None:
        """Raise :class:`TrainingDiverged` (on every rank) when a loss of ``losses``, (1-based step,
        epoch, loss) read since the last call, is not finite or over ``growth`` x the first one.
        With several ranks a collective: every rank calls it at the same steps."""
        problem = None
        for step, epoch, loss in losses:
            if self.first is None:
                self.first = loss
            problem = problem or self._problem(step, epoch, loss)
        if self.world_size > 1:
            problem = self._agreed(problem)
        if problem is not None:
            raise TrainingDiverged(problem)

    def _problem(self, step: int, epoch: int, loss: float) -> str | None:
        if math.isfinite(loss):
            first = self.first
            if first is None or not math.isfinite(first) or first <= 0 or loss <= self.growth * first:
                return None
            why = f"over {self.growth:g}x the first step's {_text(first)}"
        else:
            why = "not finite"
        rates = f" (learning rates: {self.rates})" if self.rates else ""
        return (f"training loss is {_text(loss)} at step {step} (epoch {epoch}), {why}{rates}: training diverged; "
                "lower the learning rate")

    def _agreed(self, problem: str | None) -> str | None:
        """The first flagged rank's message on every rank (None when no rank flagged one)."""
        flagged = torch.tensor([problem is not None], dtype=torch.int64)
        with collectives("the divergence check of the step losses (an all_reduce)"):
            dist.all_reduce(flagged)
            if not flagged.item():
                return None
            gathered: list[str | None] = [None] * self.world_size
            dist.all_gather_object(gathered, problem)
        first = next(rank for rank, message in enumerate(gathered) if message is not None)
        return f"rank {first}: {gathered[first]}"
