"""The ``--engine`` choices: each engine's name, where its class lives and which engine options it
reads. A leaf (no engine is imported): the config validates against it, ``--help`` stays fast, and
:func:`torchrec_tpu.train.engines.engine_for` loads the class it names."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineKind:
    """One ``--engine`` choice: where its class lives and which engine options it reads."""

    name: str
    module: str
    class_name: str
    help: str
    places_dense: bool  # --dense-device / --dense-parallel apply (else: towers on cpu in DMP's DDP)
    reads_plan: bool  # --plan applies (else: the engine plans its tables itself)
    schedules_sparse_lr: bool  # --lr-warmup-steps / --lr-decay-* reach the embedding optimizer
    runs_xla_cpu: bool  # off TPU its steps are XLA:CPU programs (its command starts with malloc set for them)
    manages_collisions: bool  # --zch applies (raw ids remapped to slots before the input dist)

    def load(self) -> type:
        return getattr(importlib.import_module(self.module), self.class_name)


ENGINES: dict[str, EngineKind] = {e.name: e for e in (
    EngineKind("torchrec", "torchrec_tpu.train.engines.torchrec_engine", "TorchRecEngine",
               "stock TorchRec DMP on FBGEMM (the reference)",
               places_dense=False, reads_plan=False, schedules_sparse_lr=True, runs_xla_cpu=False,
               manages_collisions=False),
    EngineKind("sparsecore", "torchrec_tpu.train.engines.sparsecore_engine", "SparseCoreEngine",
               "the sparsecore sharded EBC (sharded as --plan says, dense part in DDP or FSDP2, see "
               "--dense-parallel)", places_dense=True, reads_plan=True, schedules_sparse_lr=False,
               runs_xla_cpu=True, manages_collisions=True),
)}
