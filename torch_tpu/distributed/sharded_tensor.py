"""torch's ShardedTensor on ``tpu_dist`` groups: the device of a rank that holds no shard.

``ShardedTensor.device`` is the device of this rank's first local shard; on a rank without one
torch answers "cpu" for gloo and ``torch.cuda.current_device()`` for every other backend, which
raises "Torch not compiled with CUDA enabled" on a CPU build. DCP asks every rank for it when it
loads a state dict, so a sharded checkpoint in which some rank holds no piece of a table
(table-wise or column-wise sharding over fewer ranks than the world) could not load over
``tpu_dist``. :func:`register` makes such a rank answer with the device type of the tensor's
shard placements (their common type, e.g. "cpu" for ``rank:1/cpu``), current index for
accelerators; other backends keep torch's rule.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharded_tensor._ops.tensor_ops import tensor_device

from torch_tpu.distributed.process_group import BACKEND_NAME

_registered = False


def _placement_device(st: sharded_tensor.ShardedTensor) -> torch.device:
    types = {meta.placement.device().type for meta in st.metadata().shards_metadata}
    if len(types) != 1:
        raise RuntimeError(
            f"ShardedTensor of size {list(st.size())}: this rank holds no shard and the shards are "
            f"placed on several device types {sorted(types)}, so it has no device"
        )
    (kind,) = types
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())


def _device(types: Any, args: tuple = (), kwargs: Any = None, pg: Any = None) -> torch.device:
    st = args[0]
    if isinstance(st, sharded_tensor.ShardedTensor) and not st.local_shards() and pg is not None \
            and pg._get_backend_name() == BACKEND_NAME:
        return _placement_device(st)
    return tensor_device(types, args, kwargs, pg)


def register() -> None:
    """Install the rule (once; importing :mod:`torch_tpu.distributed` does)."""
    global _registered
    if not _registered:
        sharded_tensor.custom_sharded_op_impl(torch.Tensor.device.__get__)(_device)
        _registered = True
