"""``tpu_dist``: torch.distributed for tpu tensors, and topology-aware device meshes.

Importing this package registers the ``tpu_dist`` c10d backend (tpu and cpu tensors), so standard
PyTorch parallelism runs unchanged: DDP (``gradient_as_bucket_view`` too), FSDP2 ``fully_shard``,
DTensor, DCP and TorchRec sharding (uneven ``all_to_all_single``).

Launch one process per tpu device with torchrun::

    torchrun --nproc-per-node=4 examples/distributed/train_ddp.py

and in each process::

    import torch.distributed as dist
    import torch_tpu.distributed as tpu_dist

    dist.init_process_group("tpu_dist")            # reads RANK / WORLD_SIZE / MASTER_ADDR
    layout = tpu_dist.topology_aware_mesh({"dp": 2, "tp": 2})
    mesh = layout.device_mesh("tpu")              # or "cpu"

Collectives are queued on one ordered worker thread per group and return async ``Work``; the
transport enforces the group timeout, so a dead or stalled peer raises :class:`CollectiveError`
instead of hanging. tpu tensors travel through XLA collectives on their JAX arrays (ICI on a TPU
slice, JAX's gloo CPU collectives on XLA:CPU; :mod:`torch_tpu.distributed.xla_transport`) when the
processes run multi-controller JAX: the default group joins ``jax.distributed`` by itself unless
the device was used before ``init_process_group`` (then call :func:`init_xla_transport` first).
Otherwise, and for CPU tensors, an internal gloo group on host copies carries them
(:mod:`torch_tpu.distributed.transport`). :func:`active_transport` says which; choose with
``TPU_DIST_TRANSPORT=auto|xla|gloo`` or ``pg_options=TransportOptions(...)``. tpu and cpu tensors
travel on lanes of their own, so one group serves a job's device and host collectives together.
torch's ShardedTensor (TorchRec's and DCP's sharded checkpoints) works on ``tpu_dist`` groups,
ranks without a shard included (:mod:`torch_tpu.distributed.sharded_tensor`).

Functional collectives (``_c10d_functional::*``, used by DTensor ``redistribute`` and
``full_tensor``) on tpu tensors run through the core's CPU fallback, which waits for each result
before copying it to the device; inside ``torch.compile(backend="tpu")`` graphs they run through
this package's collectives between compiled segments (or inside the program, under
``torch_tpu.compile.fuse_collectives()``). :func:`topology_aware_mesh` (named dims, a
``MeshLayout``) assumes ranks follow the device enumeration order;
:func:`torch_tpu.distributed.device_mesh.topology_aware_mesh` computes the same placement from the
device coordinates every rank reports (all-gathered) and returns the rank tensor
``DeviceMesh(device_type, mesh=...)`` takes. ``torch.tpu.distributed``'s TorchTPU names (its
``topology_aware_mesh`` signature, the launch helpers) are :mod:`torch_tpu._internal.tpu_distributed`.
"""

from torch_tpu.distributed import sharded_tensor
from torch_tpu.distributed.backend import TransportOptions, active_transport, register_backend
from torch_tpu.distributed.local_launch import launch_local
from torch_tpu.distributed.mesh import MeshLayout, topology_aware_mesh
from torch_tpu.distributed.process_group import BACKEND_NAME, ProcessGroupTPU
from torch_tpu.distributed.transport import GlooTransport, Transport
from torch_tpu.distributed.worker import CollectiveError
from torch_tpu.distributed.xla_join import init_xla_transport

register_backend()
sharded_tensor.register()

__all__ = [
    "BACKEND_NAME",
    "CollectiveError",
    "GlooTransport",
    "MeshLayout",
    "ProcessGroupTPU",
    "Transport",
    "TransportOptions",
    "active_transport",
    "init_xla_transport",
    "launch_local",
    "register_backend",
    "topology_aware_mesh",
]
