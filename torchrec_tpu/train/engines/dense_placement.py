"""Where the DLRM's dense part runs (``--dense-device``) and how it is parallel (``--dense-parallel``).

The dense towers (bottom MLP, interaction / DCN cross net, over arch) and the loss move to the
dense device; the sparsecore EBC stays on the host. Forward hooks carry the data across without
changing the module tree, so checkpoints of either placement load into the other:

- the batch's dense features and labels go to the dense device as ``DLRMTrain`` is called;
- the pooled embeddings go there as the sparse arch returns (autograd copies their gradient back
  to the host, into the EBC's fused backward);
- the loss / logits / labels returned for metrics come back to the host.

Across ranks the towers are replicated with DDP or sharded with FSDP2 ``fully_shard`` over the
default ``tpu_dist`` group, which also carries the EBC's all_to_alls (tpu tensors on its device
lane, host tensors on its host lane).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRMTrain

from torchrec_tpu.train.config import OptimConfig
from torchrec_tpu.train.distributed import DistEnv
from torchrec_tpu.train.engines.dot_interaction import use_one_matmul_interaction
from torchrec_tpu.train.model import ModelSpec
from tpu_facts.switches import Switch

if TYPE_CHECKING:
    from torchrec_tpu.train.engines.dense_calibration import StepBuilder

DENSE_TOWERS = ("dense_arch", "inter_arch", "over_arch")
_POOLED_ON_HOST = Switch("pooled_on_host")


def dense_device(name: str) -> torch.device:
    """``"cpu"`` or ``"tpu"`` as a torch device (importing torch_tpu registers the tpu one)."""
    if name == "tpu":
        import torch_tpu  # noqa: F401

        return torch.device("tpu", 0)
    if name == "cpu":
        return torch.device("cpu")
    raise ValueError(f"dense device {name!r} is not one of ['cpu', 'tpu']")


def tpu_installed() -> bool:
    """Whether JAX can find a TPU runtime here (``libtpu``), asked without starting JAX."""
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


def spmd_world(world_size: int) -> bool:
    """Whether the world's ranks can run one SPMD program with collectives inside (one rank, or a
    ``tpu_dist`` world on the XLA transport: multi-controller JAX)."""
    if world_size == 1:
        return True
    if not dist.is_initialized() or dist.get_backend() != "tpu_dist":
        return False
    import torch_tpu.distributed as tpu_dist

    return tpu_dist.active_transport() == "xla"


def resolve_dense_device(choice: str, spec: ModelSpec, world_size: int, dense_parallel: str, local_batch: int,
                         optim: OptimConfig = OptimConfig(), sparse_backend: str = "auto",
                         ids_per_feature: tuple[int, ...] | None = None,
                         build_step: StepBuilder | None = None) -> torch.device:
    """The sparsecore engine's dense device for ``--dense-device choice``. ``auto``: tpu where the
    step compiles into one program per rank (ddp, :func:`spmd_world`) and either the tpu device is
    an accelerator or, on XLA:CPU in one process, the job's whole step (towers, embedding lookup
    and update, as ``build_step`` builds it) runs faster that way than with the towers in CPU eager
    torch on this host, at ``local_batch`` samples per rank and step with ``optim``, ``--sparse-backend
    sparse_backend`` and ``ids_per_feature`` ids per sample (``--multi-hot-sizes``; None: one),
    measured once and stored (:mod:`~torchrec_tpu.train.engines.dense_calibration`); else cpu.
    (Several XLA:CPU processes on one host: their SPMD step, whose collectives are gloo's inside
    XLA, is slower than the eager cpu towers with host all-to-alls: docs/PERFORMANCE.md.)"""
    if choice != "auto":
        return dense_device(choice)
    if dense_parallel != "ddp" or not spmd_world(world_size):
        return dense_device("cpu")
    import jax

    if jax.devices()[0].platform != "cpu":
        return dense_device("tpu")
    if world_size > 1:
        return dense_device("cpu")
    if build_step is None:
        raise ValueError("--dense-device auto on XLA:CPU times the training step both ways: "
                         "resolve_dense_device needs the engine's build_step")
    from torchrec_tpu.train.engines.dense_calibration import measured_dense_device

    return dense_device(measured_dense_device(build_step, spec, local_batch, optim, sparse_backend, ids_per_feature))


def place_dense(model: DLRMTrain, device: torch.device) -> None:
    """Move ``model``'s dense towers to ``device`` and hook the data paths in and out of it; on
    the host, DLRM's dot interaction gets its one-matmul backward (:mod:`.dot_interaction`)."""
    dlrm = model.model
    for name in DENSE_TOWERS:
        getattr(dlrm, name).to(device)
    if device.type == "cpu":
        use_one_matmul_interaction(dlrm)
        return
    dlrm.sparse_arch.register_forward_hook(
        lambda _module, _args, pooled: pooled if _POOLED_ON_HOST.is_on() else pooled.to(device))
    model.register_forward_pre_hook(lambda _module, args: _batch_to(args, device))
    model.register_forward_hook(lambda _module, _args, output: _outputs_to_host(output))


def pooled_on_host() -> AbstractContextManager[None]:
    """Inside, the sparse arch's output stays on the host (for a caller that hands it to a
    compiled tpu program itself, without an eager copy)."""
    return _POOLED_ON_HOST.on()


def _batch_to(args: tuple[Any, ...], device: torch.device) -> tuple[Batch]:
    (batch,) = args
    return (Batch(dense_features=batch.dense_features.to(device), sparse_features=batch.sparse_features,
                  labels=batch.labels.to(device)),)


def _outputs_to_host(output: tuple[torch.Tensor, tuple[torch.Tensor, ...]]):
    loss, aux = output
    return loss, tuple(t.cpu() for t in aux)


class DenseDDP(DistributedDataParallel):
    """DDP whose state dict is the wrapped model's (no ``module.`` prefix), so checkpoints of any
    world size load into any other, and into the unwrapped 1-rank model."""

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.module.load_state_dict(*args, **kwargs)


def parallelize_dense(model: DLRMTrain, env: DistEnv, device: torch.device, parallel: str,
                      ignored: list[str]) -> nn.Module:
    """``model`` with its dense towers synced over the ranks: ``"ddp"`` wraps it (parameters named
    in ``ignored``, the EBC's, stay out), ``"fsdp2"`` shards each tower's parameters in place."""
    if parallel == "ddp":
        if env.world_size == 1:
            return model
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
        # TorchRec DMP's DDP options: no sync of the (constant) buffers every forward, e.g.
        # DLRM's triu_indices (synced once at init); on cpu also gradients as views of the buckets
        # and a static graph (on tpu those need a pinned-memory allocator the device does not have)
        on_host = device.type == "cpu"
        return DenseDDP(model, forward_sync_buffers=False, gradient_as_bucket_view=on_host,
                        static_graph=on_host)
    if parallel == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
        for name in DENSE_TOWERS:
            tower = getattr(model.model, name)
            if next(tower.parameters(), None) is not None:  # DLRM's dot interaction has none
                fully_shard(tower, mesh=mesh)
        return model
    raise ValueError(f"dense parallel {parallel!r} is not one of ['ddp', 'fsdp2']")
