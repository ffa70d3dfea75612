"""The two embedding engines of ``torchrec-tpu train`` / ``profile``, peers behind one interface.

- ``sparsecore`` (:mod:`torchrec_tpu.train.engines.sparsecore_engine`, the default): the DLRM's EBC
  replaced by our ``ShardedSparseCoreEBC``, the dense towers in DDP / FSDP2 on cpu or tpu;
- ``torchrec`` (:mod:`torchrec_tpu.train.engines.torchrec_engine`): stock TorchRec DMP on FBGEMM, the
  reference the equality tests and ``bench/bench_train_e2e.py`` compare to.

The registry :data:`~torchrec_tpu.train.engine_kinds.ENGINES` (a leaf below the config) names each
engine and what it supports; the job asks the engine object itself
(:attr:`Engine.needs_device_tensors`), never its name.

Each builds the sharded model from a :class:`~torchrec_tpu.train.model.ModelSpec` and its optimizer,
and wraps the training batches (rank agreement, input-dist prefetch) and the step; the job, the
profiler and the tests call only this interface. (Serving, ``torchrec-tpu infer``, loads either
engine's checkpoint into the unsharded model: both name the tables as
:mod:`torchrec_tpu.train.model` says.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Protocol

from torchrec_tpu.train.engine_kinds import ENGINES

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.optim import Optimizer
    from torchrec.datasets.utils import Batch

    from torchrec_tpu.train.config import TrainConfig
    from torchrec_tpu.train.distributed import DistEnv
    from torchrec_tpu.train.engines.step_layout import StepLayout
    from torchrec_tpu.train.learning_rate import LearningRates, LRPolicy
    from torchrec_tpu.train.loop import StepFn
    from torchrec_tpu.train.metrics import EvalForward
    from torchrec_tpu.train.model import ModelSpec


class Engine(Protocol):
    """What the training job needs of an embedding engine."""

    name: str

    @property
    def needs_device_tensors(self) -> bool:
        """Whether the process group must carry tpu tensors (dense towers on the tpu device)."""
        ...

    def step_layout(self, spec: ModelSpec, env: DistEnv) -> StepLayout:
        """How this job's step is laid out (dense device, sparse backend, one program or not):
        decided once, before the model is built, and passed to the calls below."""
        ...

    def build_model(self, spec: ModelSpec, env: DistEnv, device: torch.device, layout: StepLayout) -> nn.Module:
        """The ``DLRMTrain`` of ``spec``, sharded over ``env``'s world (a collective) as ``layout``
        says; ``device``: where the loop puts the batches."""
        ...

    def build_optimizer(self, model: nn.Module, layout: StepLayout) -> Optimizer:
        """The optimizer ``loss.backward(); optimizer.step()`` trains ``model`` with (the fused
        embedding update runs in backward), for ``layout``'s dense device; its ``state_dict`` is the
        checkpoint's."""
        ...

    def wrap_batches(self, batches: Iterable[Batch], model: nn.Module, env: DistEnv, device: torch.device,
                     background: bool = True) -> Iterable[Batch]:
        """The training stream as this engine consumes it (re-iterable, seekable like ``batches``);
        ``background=False`` keeps all work on the caller's thread (the profiler)."""
        ...

    def step_function(self, model: nn.Module, optimizer: Optimizer, layout: StepLayout) -> StepFn:
        """The training step ``run_training`` calls."""
        ...

    def eval_forward(self, model: nn.Module, layout: StepLayout) -> EvalForward:
        """How ``run_training`` evaluates ``model`` on a held-out batch."""
        ...

    def learning_rates(self, policy: LRPolicy, model: nn.Module, optimizer: Optimizer) -> LearningRates:
        """The per-step learning rates of ``policy`` over this engine's optimizers."""
        ...

    def sharding_plan(self, model: nn.Module) -> str:
        """Where each table of ``model`` went (``--print-sharding-plan``), as lines of text."""
        ...


EAGER_STEP = "eager train_step (forward, backward and optimizer step op by op)"


def step_program_name(step_fn: StepFn) -> str:
    """What runs a step of ``step_fn``: its ``program_name`` (a compiled step's), else the eager step."""
    return getattr(step_fn, "program_name", EAGER_STEP)


def engine_for(config: TrainConfig) -> Engine:
    """The engine ``config.engine.kind`` names, given its config groups."""
    return ENGINES[config.engine.kind].load().from_config(config)
