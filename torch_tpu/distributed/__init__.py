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
transport (gloo on host copies today, see :mod:`torch_tpu.distributed.transport`) enforces the
group timeout, so a dead or stalled peer raises :class:`CollectiveError` instead of hanging.

Needs from the torch_tpu core (not in this package):

* ``_c10d_functional::*`` ops (functional collectives; DTensor ``redistribute``/``full_tensor``)
  must be redispatched with the tpu tensors in ``__torch_dispatch__``. Today they hit the CPU
  fallback, which copies the output to the device before ``wait_tensor`` has filled it, so DTensor
  on tpu tensors returns garbage (racy). On cpu tensors the same ops work over ``tpu_dist``.
* ``torch.tpu.topology_aware_mesh`` can alias :func:`topology_aware_mesh`.
"""

from torch_tpu.distributed.backend import register_backend
from torch_tpu.distributed.local_launch import launch_local
from torch_tpu.distributed.mesh import MeshLayout, SliceTopology, topology_aware_mesh
from torch_tpu.distributed.process_group import BACKEND_NAME, ProcessGroupTPU
from torch_tpu.distributed.transport import GlooTransport, Transport
from torch_tpu.distributed.worker import CollectiveError

register_backend()

__all__ = [
    "BACKEND_NAME",
    "CollectiveError",
    "GlooTransport",
    "MeshLayout",
    "ProcessGroupTPU",
    "SliceTopology",
    "Transport",
    "launch_local",
    "register_backend",
    "topology_aware_mesh",
]
