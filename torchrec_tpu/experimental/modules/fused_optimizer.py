"""The optimizer side of TorchRec TPU's fused SparseCore modules: which torch optimizers fuse into
``tpu::sparse_dense_matmul_grad_with_<name>``, their hyperparameters, and the
``SparseCoreFusedOptimizer`` view of a module's tables (TorchRec's ``FusedOptimizer``), through
which LR schedulers reach :meth:`set_learning_rate`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torchrec.optim.fused import FusedOptimizer

from torch_tpu.ops.sparsecore import SLOTS

# TorchRec TPU's aliases (legacy names) -> torch.optim's names
_ALIASES = {"learning_rate": "lr", "epsilon": "eps", "beta1": "beta1", "beta2": "beta2"}


@dataclasses.dataclass(frozen=True)
class FusedOptimizerKind:
    """One torch optimizer that SparseCore fuses: its op name and the kwargs it honours, with
    torch.optim's defaults (``lr`` defaults to TorchRec TPU's 0.01)."""

    op_name: str
    defaults: Mapping[str, float]

    @property
    def slots(self) -> tuple[str, ...]:
        return SLOTS[self.op_name]


FUSED_OPTIMIZERS: dict[type[torch.optim.Optimizer], FusedOptimizerKind] = {
    torch.optim.SGD: FusedOptimizerKind("sgd", {"lr": 0.01}),
    torch.optim.Adagrad: FusedOptimizerKind("adagrad", {"lr": 0.01, "eps": 1e-10, "initial_accumulator_value": 0.0}),
    torch.optim.Adam: FusedOptimizerKind("adam", {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}),
}


def fused_kind(optimizer_type: type[torch.optim.Optimizer]) -> FusedOptimizerKind:
    """The fused form of ``optimizer_type``; ValueError naming the supported ones otherwise."""
    kind = FUSED_OPTIMIZERS.get(optimizer_type)
    if kind is None:
        names = [f"torch.optim.{t.__name__}" for t in FUSED_OPTIMIZERS]
        raise ValueError(f"optimizer_type {optimizer_type!r} has no fused SparseCore update; supported: {names}")
    return kind


def normalize_kwargs(optimizer_type: type[torch.optim.Optimizer], kwargs: Mapping[str, Any] | None
                     ) -> dict[str, float]:
    """``kwargs`` in canonical names (``lr``, ``eps``, ``beta1``, ``beta2``, ...; ``betas`` and the
    legacy ``learning_rate`` / ``epsilon`` accepted) over the optimizer's defaults. A kwarg the
    fused update cannot honour raises ValueError naming it."""
    kind = fused_kind(optimizer_type)
    given = dict(kwargs or {})
    if "betas" in given:
        given["beta1"], given["beta2"] = given.pop("betas")
    given = {_ALIASES.get(k, k): v for k, v in given.items()}
    unknown = sorted(set(given) - set(kind.defaults))
    if unknown:
        raise ValueError(f"optimizer_kwargs {unknown} are not supported by the fused {optimizer_type.__name__} "
                         f"update; it takes {sorted(kind.defaults)}")
    out = {**kind.defaults, **{k: float(v) for k, v in given.items()}}
    if out["lr"] < 0:
        raise ValueError(f"optimizer_kwargs lr must be >= 0, got {out['lr']}")
    return out


def adam_step_hyperparameters(lr: float, beta1: float, beta2: float, eps: float, step: int) -> tuple[float, float]:
    """(alpha_t, epsilon_hat) of Adam's ``step``-th update (from 1) with torch.optim.Adam's bias
    corrections folded in, in double: ``lr * sqrt(1 - b2^t) / (1 - b1^t)`` and
    ``eps * sqrt(1 - b2^t)``."""
    correction2 = math.sqrt(1.0 - beta2**step)
    return lr * correction2 / (1.0 - beta1**step), eps * correction2


class FusedTables(Protocol):
    """What :class:`SparseCoreFusedOptimizer` reads from a fused module."""

    def optimizer_params(self) -> dict[str, torch.Tensor]: ...

    def optimizer_state(self) -> dict[torch.Tensor, dict[str, torch.Tensor]]: ...

    def get_initial_lr(self) -> float: ...

    def set_learning_rate(self, lr: float) -> None: ...


class SparseCoreFusedOptimizer(FusedOptimizer):
    """TorchRec's ``FusedOptimizer`` over a fused SparseCore module: the update already ran in
    ``loss.backward()``, so ``step()`` / ``zero_grad()`` only pass a changed ``lr`` of the param
    group (an LR scheduler's) on to the module's ``set_learning_rate``. Its state is the module's
    slot tensors (``<stack>.weight.<slot>``)."""

    def __init__(self, module: FusedTables) -> None:
        self._module = module
        params = module.optimizer_params()
        lr = module.get_initial_lr()
        super().__init__(params, module.optimizer_state(), [{"params": list(params.values()), "lr": lr}])
        self._synced_lr = lr

    def _sync_lr(self) -> None:
        lr = float(self.param_groups[0]["lr"])
        if lr != self._synced_lr:
            self._module.set_learning_rate(lr)
            self._synced_lr = lr

    def step(self, closure: Any = None) -> None:
        self._sync_lr()

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._sync_lr()
