"""Learning rates per step: TorchRec ``dlrm_main``'s / MLPerf DLRM's ``LRPolicyScheduler`` policy,
applied to the dense and the fused sparse optimizer alike, and the values logged each step.

At 1-based step s: ``base * s / warmup`` while s < warmup; ``base * ((n - (s - start)) / n) ** 2``
(at least 1e-7) for start <= s < start + n; held at the last decayed value after that; ``base``
otherwise. (TorchRec holds its last warm-up value between warm-up and decay; here it is ``base``.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

MIN_DECAYED_LR = 1e-7  # TorchRec's floor during decay


@dataclass(frozen=True)
class LRPolicy:
    """Scale of the base learning rate at (1-based) step ``step``; all zero: constant."""

    warmup_steps: int = 0
    decay_start: int = 0
    decay_steps: int = 0

    @property
    def constant(self) -> bool:
        return not (self.warmup_steps or self.decay_steps)

    def lr(self, base: float, step: int) -> float:
        if step < self.warmup_steps:
            return base * step / self.warmup_steps
        if self.decay_steps and step >= self.decay_start:
            decayed = min(step - self.decay_start, self.decay_steps - 1)
            return max(MIN_DECAYED_LR, base * ((self.decay_steps - decayed) / self.decay_steps) ** 2)
        return base


class LearningRates:
    """Sets every step's learning rate on the optimizers' param groups and reports both rates.

    ``sparse_groups``: the fused embedding optimizer's groups (the torchrec engine); ``None`` when
    the sparse rate is fixed at build time (the sparsecore engine), which ``policy`` must then be
    constant for. ``push_sparse`` hands changed sparse groups to the fused kernels before backward.
    """

    def __init__(self, policy: LRPolicy, dense_groups: Sequence[dict[str, Any]], dense_lr: float,
                 sparse_groups: Sequence[dict[str, Any]] | None, sparse_lr: float,
                 push_sparse: Any = None) -> None:
        if sparse_groups is None and not policy.constant:
            raise ValueError("a learning-rate schedule needs --engine torchrec: the sparsecore "
                             "engine's fused optimizer has a fixed learning rate")
        self.policy, self.dense_groups, self.dense_lr = policy, dense_groups, dense_lr
        self.sparse_groups, self.sparse_lr, self._push_sparse = sparse_groups, sparse_lr, push_sparse

    def at(self, step: int) -> dict[str, float]:
        """Apply the rates of (1-based) ``step``; return them as TensorBoard scalars."""
        dense, sparse = self.policy.lr(self.dense_lr, step), self.policy.lr(self.sparse_lr, step)
        if not self.policy.constant:
            for group in self.dense_groups:
                group["lr"] = dense
            for group in self.sparse_groups or ():
                group["lr"] = sparse
            if self._push_sparse is not None:
                self._push_sparse()
        return {"train/learning_rate/dense": dense, "train/learning_rate/sparse": sparse}
