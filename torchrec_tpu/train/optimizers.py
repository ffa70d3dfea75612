"""The optimizer vocabulary of ``torchrec-tpu train``: every ``--sparse-optimizer`` and
``--dense-optimizer`` name, once, with what each engine builds from it.

A sparse (embedding) optimizer is fused into backward in both engines: the torchrec engine hands
its torch optimizer class to ``apply_optimizer_in_backward`` (FBGEMM's TBE runs the matching
``EXACT_*`` update), the sparsecore engine builds the :class:`sparsecore.OptimizerSpec` doing the
same update (accumulators start at 0, FBGEMM's default eps 1e-8); its slots are the planner's
(``tpu_facts.OPTIMIZER_SLOTS``). A dense optimizer is a plain torch optimizer over the towers;
dense Adagrad takes the sparse one's eps (:data:`ADAGRAD_EPS`, as MLPerf DLRM-DCNv2's reference;
torch's default is 1e-10), so one eps holds for the whole model.

The config's validation reads the names from here, so nothing heavy is imported at module level
(``--help`` stays fast): the classes are resolved on first use.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from tpu_facts import OPTIMIZER_SLOTS

if TYPE_CHECKING:
    import torch

    from sparsecore import OptimizerSpec


def _resolve(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class SparseOptimizer:
    """One fused embedding optimizer, as each engine runs it."""

    name: str
    torch_class_path: str  # the torchrec engine's class (FBGEMM fuses it: torchrec's optimizer_type_to_emb_opt_type)
    sparsecore_class: str  # the sparsecore engine's OptimizerSpec (a name in ``sparsecore``)
    sparsecore_options: Mapping[str, float] = field(default_factory=dict)

    def torch_class(self) -> type[torch.optim.Optimizer]:
        return _resolve(self.torch_class_path)

    def sparsecore_spec(self, lr: float) -> OptimizerSpec:
        """The sparsecore optimizer doing what FBGEMM's fused one does."""
        return _resolve(f"sparsecore.{self.sparsecore_class}")(lr, **self.sparsecore_options)

    @property
    def slots(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(per-weight slots, per-row slots), the planner's table."""
        return OPTIMIZER_SLOTS[self.name]


@dataclass(frozen=True)
class DenseOptimizer:
    """One optimizer of the dense towers."""

    name: str
    torch_class_path: str
    options: Mapping[str, float] = field(default_factory=dict)  # constructor arguments besides lr

    def torch_class(self) -> type[torch.optim.Optimizer]:
        return _resolve(self.torch_class_path)

    def build(self, params: Any, lr: float, **extra: Any) -> torch.optim.Optimizer:
        """The optimizer over ``params`` at learning rate ``lr`` (``extra``: e.g. ``foreach``)."""
        return self.torch_class()(params, lr=lr, **self.options, **extra)


ADAGRAD_EPS = 1e-8  # FBGEMM's fused Adagrad's default, MLPerf DLRM-DCNv2's (both optimizers)
_FBGEMM_DEFAULTS = {"initial_accumulator_value": 0.0, "eps": ADAGRAD_EPS}
SPARSE_OPTIMIZERS: dict[str, SparseOptimizer] = {o.name: o for o in (
    SparseOptimizer("adagrad", "torch.optim.Adagrad", "Adagrad", _FBGEMM_DEFAULTS),  # EXACT_ADAGRAD
    SparseOptimizer("rowwise_adagrad", "torchrec.optim.RowWiseAdagrad", "RowWiseAdagrad",
                    _FBGEMM_DEFAULTS),  # EXACT_ROWWISE_ADAGRAD: one accumulator per row
    SparseOptimizer("sgd", "torch.optim.SGD", "SGD"),  # EXACT_SGD
)}
DENSE_OPTIMIZERS: dict[str, DenseOptimizer] = {o.name: o for o in (
    DenseOptimizer("adagrad", "torch.optim.Adagrad", {"eps": ADAGRAD_EPS}),
    DenseOptimizer("adam", "torch.optim.Adam"),
    DenseOptimizer("sgd", "torch.optim.SGD"),  # TorchRec dlrm_main's without --adagrad
)}


def sparse_optimizer(name: str) -> SparseOptimizer:
    if name not in SPARSE_OPTIMIZERS:
        raise ValueError(f"sparse optimizer {name!r} is not one of {list(SPARSE_OPTIMIZERS)}")
    return SPARSE_OPTIMIZERS[name]


def dense_optimizer(name: str) -> DenseOptimizer:
    if name not in DENSE_OPTIMIZERS:
        raise ValueError(f"dense optimizer {name!r} is not one of {list(DENSE_OPTIMIZERS)}")
    return DENSE_OPTIMIZERS[name]
