"""``torchrec.experimental.torch_tpu.checkpoint.planners``: torch.distributed.checkpoint (DCP)
planners for the fused SparseCore modules' MOD-sharded tables.

:class:`SparseCoreSavePlanner` records the SparseCore topology it saved at (world size, SparseCores
per device) in the checkpoint metadata. :class:`SparseCoreLoadPlanner` loads such a checkpoint at
the same topology as DCP does, at another one (``world_size x num_sc_per_device`` SparseCores:
each table is un-MOD-sharded from the saved layout and MOD-sharded into the target's), or with
``unshard_for_cpu=True`` into a plain TorchRec ``EmbeddingBagCollection`` / ``EmbeddingCollection``
(logical ``[num_embeddings, embedding_dim]`` tables). As TorchRec TPU's, they treat each stacked
table as one MOD-sharded table: exact for a table that is its own stack (no ``stack_table_name``);
a stack of several tables reloads at its own topology only (load its logical tables with
``set_unstacked_table_weights`` elsewhere).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem, SavePlan, WriteItem

PLANNER_DATA_KEY = "sparsecore"
# a fused module's tables and optimizer slots, by state_dict name
_SHARDED = re.compile(r"(^|\.)((embedding_bags|embeddings)\.[^.]+\.weight|(accumulators|momentums|velocities)\.[^.]+)$")


def is_sparsecore_table(fqn: str) -> bool:
    """Whether ``fqn`` names a fused module's table or optimizer slot (or a TorchRec EBC/EC table)."""
    return _SHARDED.search(fqn) is not None


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def unshard(table: torch.Tensor, num_shards: int) -> torch.Tensor:
    """The logical rows of a MOD-sharded table (shard-major: physical row ``s * rows/N + r`` holds
    logical row ``r * N + s``)."""
    rows = table.shape[0]
    if rows % num_shards:
        raise ValueError(f"a table of {rows} rows cannot be MOD-sharded over {num_shards} SparseCores")
    return table.reshape(num_shards, rows // num_shards, *table.shape[1:]).transpose(0, 1).reshape(table.shape)


def shard(table: torch.Tensor, num_shards: int) -> torch.Tensor:
    """Inverse of :func:`unshard`."""
    rows = table.shape[0]
    if rows % num_shards:
        raise ValueError(f"a table of {rows} rows cannot be MOD-sharded over {num_shards} SparseCores")
    return table.reshape(rows // num_shards, num_shards, *table.shape[1:]).transpose(0, 1).reshape(table.shape)


class SparseCoreSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that also records the SparseCore topology (``world_size``,
    ``num_sc_per_device``) in ``metadata.planner_data["sparsecore"]``; tpu tensors are written
    through the host."""

    def __init__(self, num_sc_per_device: int = 2, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_sc_per_device = num_sc_per_device

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = super().create_global_plan(all_plans)
        data = dict(metadata.planner_data or {})
        data[PLANNER_DATA_KEY] = {"world_size": _world_size(), "num_sc_per_device": self.num_sc_per_device}
        return plans, dataclasses.replace(metadata, planner_data=data)

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = super().resolve_data(write_item)
        return data.cpu() if isinstance(data, torch.Tensor) and data.device.type == "tpu" else data


@dataclasses.dataclass
class _Pending:
    """A table read whole into a host buffer, written into ``target`` once every element arrived."""

    target: torch.Tensor
    buffer: torch.Tensor
    received: int = 0


class SparseCoreLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that re-lays out SparseCore tables saved by
    :class:`SparseCoreSavePlanner`: at another topology (``world_size x num_sc_per_device``) or,
    with ``unshard_for_cpu``, into plain logical tables (rows and columns beyond the target's are
    the saved padding and are dropped)."""

    def __init__(self, num_sc_per_device: int = 2, unshard_for_cpu: bool = False, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_sc_per_device = num_sc_per_device
        self.unshard_for_cpu = unshard_for_cpu
        self.saved_topology: dict[str, int] | None = None
        self._pending: dict[str, _Pending] = {}

    @property
    def cross_topology(self) -> bool:
        """Whether the checkpoint was saved at another SparseCore topology than this process's."""
        saved = self.saved_topology
        return saved is not None and (saved["world_size"], saved["num_sc_per_device"]) != (
            _world_size(), self.num_sc_per_device)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        data = metadata.planner_data if metadata is not None else None
        self.saved_topology = data.get(PLANNER_DATA_KEY) if isinstance(data, dict) else None
        self._pending = {}
        if self.unshard_for_cpu and self.saved_topology is None:
            raise ValueError("unshard_for_cpu=True needs a checkpoint saved with SparseCoreSavePlanner (its metadata "
                             "has no 'sparsecore' topology)")
        if metadata is not None and (self.unshard_for_cpu or self.cross_topology):
            state_dict = dict(state_dict)
            for fqn, target in list(state_dict.items()):
                saved = metadata.state_dict_metadata.get(fqn)
                if not is_sparsecore_table(fqn) or saved is None or not isinstance(target, torch.Tensor):
                    continue
                buffer = torch.empty(tuple(saved.size), dtype=saved.properties.dtype)
                self._pending[fqn] = _Pending(target, buffer)
                state_dict[fqn] = buffer
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        pending = self._pending.get(read_item.dest_index.fqn)
        if pending is None:
            return
        pending.received += math.prod(read_item.lengths)
        if pending.received == pending.buffer.numel():
            self._write(pending)
            del self._pending[read_item.dest_index.fqn]

    def _write(self, pending: _Pending) -> None:
        saved = self.saved_topology
        logical = unshard(pending.buffer, saved["world_size"] * saved["num_sc_per_device"])
        target = pending.target
        local = target.to_local() if hasattr(target, "to_local") else target
        with torch.no_grad():
            if self.unshard_for_cpu:
                local.copy_(logical[tuple(slice(0, n) for n in target.shape)])
                return
            world = _world_size()
            rows = target.shape[0]  # a DTensor's global rows
            full = torch.zeros((rows, *logical.shape[1:]), dtype=logical.dtype)
            keep = min(rows, logical.shape[0])
            full[:keep] = logical[:keep]
            resharded = shard(full, world * self.num_sc_per_device)
            per_rank = rows // world
            local.copy_(resharded[_rank() * per_rank:(_rank() + 1) * per_rank].to(local.device))


__all__ = ["SparseCoreLoadPlanner", "SparseCoreSavePlanner"]
