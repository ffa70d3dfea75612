"""How a job's training step is laid out, decided once at its start and passed down (as
torchtitan's ``ParallelDims``): where the dense towers run and how they sync, which sparse backend
looks the tables up, whether the step is one compiled program per rank and whether the embedding
lookup and update run inside it, whether the ranks' stacks are padded to one shape for it, and the
towers' precision. Nothing later re-decides these: a later fact that contradicts the layout (a plan
whose ranks' stacks cannot be padded to one shape) fails the job, naming the flag that changes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sparsecore.backends import FBGEMM, OPS, TPU, XLA, BackendName
from sparsecore.optimizer_rules import rule_of
from torchrec_tpu.train.config import ConfigError, EngineConfig, OptimConfig
from torchrec_tpu.train.engines.dense_placement import dense_device, resolve_dense_device, spmd_world, tpu_installed
from torchrec_tpu.train.engines.plan_loading import rank_sparsecores
from torchrec_tpu.train.model import ModelSpec
from torchrec_tpu.train.optimizers import sparse_optimizer
from tpu_facts import local_batch_of, padded_local_batch_of

if TYPE_CHECKING:
    from torchrec_tpu.train.engines.dense_calibration import StepBuilder

# `--dense-device auto` times whole steps at the job's batch up to this many samples per rank: the
# rate per sample is flat well below it, and a job whose batch cannot fit (it fails on its id limits
# when the tables are planned, next) must not first allocate that batch's towers to time them
CALIBRATION_BATCH_CAP = 16384


@dataclass(frozen=True)
class StepLayout:
    """One job's step layout (see the module docstring); ``sparse_backend`` is a name of
    ``sparsecore.backends.BACKENDS`` (``fbgemm`` for the torchrec engine: FBGEMM's fused TBE inside
    TorchRec's DMP); ``lookup_in_step``: the embedding lookup and update run inside the one program
    (else ``lookup_outside`` says why they run outside it)."""

    dense_device: torch.device
    dense_parallel: str
    sparse_backend: BackendName
    one_program: bool
    lookup_in_step: bool
    uniform_ranks: bool
    precision: str
    world_size: int
    lookup_outside: str = ""

    def describe(self) -> str:
        """One log line."""
        if not self.one_program:
            step = "an eager step"
        elif self.lookup_in_step:
            step = "one compiled program per step and rank (embedding lookup and update inside)"
        else:
            step = (f"the towers as one compiled program per step and rank, the embedding lookup and update "
                    f"outside it ({self.lookup_outside})")
        return (f"training layout: dense towers on {self.dense_device.type} ({self.dense_parallel}, "
                f"{self.precision}), sparse backend {self.sparse_backend}, {step}, {self.world_size} rank(s)")


def one_step_program(dense_device: torch.device, world_size: int, dense_parallel: str) -> bool:
    """Whether the step runs as one compiled program per rank (towers, dense optimizer, embedding
    lookup and update; with several ranks SPMD over the world, which needs multi-controller JAX:
    tpu_dist's XLA transport)."""
    # the towers' parameters are plain tpu tensors with ``ddp`` (DDP's own hooks never run: the
    # program averages the gradients itself); FSDP2 shards them as DTensors, which run eagerly
    return dense_device.type == "tpu" and dense_parallel == "ddp" and spmd_world(world_size)


def sparsecore_layout(options: EngineConfig, optim: OptimConfig, world_size: int, local_batch: int,
                      towers_on: torch.device) -> StepLayout:
    """The sparsecore engine's layout with the dense towers on ``towers_on`` and ``local_batch``
    samples per rank: ``--sparse-backend auto`` is ``ops`` where the step is one program that calls
    the ops itself (an optimizer that runs inside the step) and without ``--fdo``, else ``xla``.
    The lookup runs inside that program where its backend is ``ops``, the optimizer runs inside the step and the
    SparseCores split the batch with no padding (:func:`lookup_outside`); several ranks then need
    uniform stacks. ``tpu`` needs a TPU host: elsewhere it is refused here, before any table is built."""
    one_program = one_step_program(towers_on, world_size, options.dense_parallel)
    in_step = rule_of(sparse_optimizer(optim.sparse_optimizer).sparsecore_spec(optim.sparse_lr)).in_step
    backend = options.sparse_backend
    if backend == "auto":  # (--fdo raises the limits during the run, which only xla takes)
        backend = OPS if one_program and in_step and not options.fdo else XLA
    if backend == TPU and not tpu_installed():
        raise ConfigError(f"--sparse-backend={TPU!r} runs jax-tpu-embedding's SparseCore kernels, which only a TPU "
                          f"host executes (no libtpu here); --sparse-backend={XLA!r} computes the same on any host")
    outside = lookup_outside(backend, optim.sparse_optimizer, in_step, rank_sparsecores(options.plan, world_size),
                             world_size, local_batch) if one_program else ""
    inside = one_program and not outside
    return StepLayout(towers_on, options.dense_parallel, backend, one_program, inside, world_size > 1 and inside,
                      optim.precision, world_size, outside)


def lookup_outside(backend: BackendName, optimizer: str, in_step: bool, sparsecores: int, world_size: int,
                   local_batch: int) -> str:
    """Why a one-program step's embedding lookup and update run outside its program (with the
    flag that changes it), or "" where they run inside."""
    if backend != OPS:
        return f"--sparse-backend {backend}; the ops backend runs them inside"
    if not in_step:
        return f"--sparse-optimizer {optimizer} reads a host value every step"
    if padded_local_batch_of(local_batch, sparsecores, world_size) != local_batch:
        multiple = padded_local_batch_of(1, sparsecores, world_size)
        return (f"a per-rank batch of {local_batch} is not a multiple of {multiple}, so the {sparsecores} "
                f"SparseCores of each of {world_size} rank(s) take it padded; --batch-size a multiple of "
                f"{multiple * world_size} runs them inside")
    return ""


def resolve_sparsecore_layout(options: EngineConfig, optim: OptimConfig, spec: ModelSpec, world_size: int,
                              global_batch: int, ids_per_feature: tuple[int, ...] | None = None,
                              build_step: StepBuilder | None = None) -> StepLayout:
    """:func:`sparsecore_layout` with the towers where ``--dense-device`` says (``auto`` may time the
    step ``build_step`` builds on this host, once, with ``ids_per_feature`` ids per sample (None:
    one): :func:`~torchrec_tpu.train.engines.dense_placement.resolve_dense_device`)."""
    towers_on = resolve_dense_device(options.dense_device, spec, world_size, options.dense_parallel,
                                     min(local_batch_of(global_batch, world_size), CALIBRATION_BATCH_CAP), optim,
                                     options.sparse_backend, ids_per_feature, build_step)
    return sparsecore_layout(options, optim, world_size, local_batch_of(global_batch, world_size), towers_on)


def torchrec_layout(optim: OptimConfig, world_size: int) -> StepLayout:
    """Stock TorchRec's: towers on the host in DMP's DDP, tables on FBGEMM, an eager step."""
    return StepLayout(dense_device("cpu"), "ddp", FBGEMM, False, False, False, optim.precision, world_size)
