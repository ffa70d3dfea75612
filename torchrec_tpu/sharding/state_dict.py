"""Checkpoint state of a sharded EBC: each rank's rows and columns as pieces of the full tables, so
torch.distributed.checkpoint (DCP) writes every piece once, on the rank that holds it.

Keys (under the module's prefix), named like the tables of TorchRec's EBC (``embedding_bags``)
or EC (``embeddings``), the ``container``:

- ``<container>.<table>.weight``: [vocab, dim]
- ``optimizer_slots.<table>.<slot>``: [vocab, dim], or [vocab] for a row slot ([c * vocab] for a
  table in c column blocks: each block keeps its own, as TorchRec's column-wise sharding does)
- ``optimizer_step_count``: fused updates applied so far (0-d int64, the same on every rank)

Each table tensor has its full logical shape: a ShardedTensor whose shards are the boxes the
ranks hold (table-wise: the whole table on its owner; column-wise: a column block per rank), or,
data-parallel and on a single rank, a plain tensor (DCP writes a replicated tensor once).
Row-wise shards hold rows ``rank mod W``, which no box describes: they are regrouped by one
all_to_all into contiguous row blocks for saving, and back after loading. As every checkpoint
describes whole tables, DCP reshards it to another world size or layout, and a plain TorchRec EBC
or the serving model loads it directly.

Any process group works: gloo, or ``tpu_dist`` as training uses (importing
:mod:`torch_tpu.distributed` teaches torch's ShardedTensor the device of a rank that holds no
piece of a table, which it otherwise takes to be CUDA on every backend but gloo).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as TensorShard
from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata, TensorProperties

from sparsecore.backends.base import TableTensors
from sparsecore.specs import TableSpec
from torchrec_tpu.sharding.collectives import all_to_all
from torchrec_tpu.sharding.shards import Shard, row_slot_size

STEP_COUNT = "optimizer_step_count"


def weight_key(container: str, table: str) -> str:
    return f"{container}.{table}.weight"


def slot_key(table: str, slot: str) -> str:
    return f"optimizer_slots.{table}.{slot}"


def state_keys(container: str, tables: Mapping[str, TableSpec]) -> list[str]:
    """Every key :func:`checkpoint_state` writes, in its order."""
    keys = []
    for name, spec in tables.items():
        keys += [weight_key(container, name)] + [slot_key(name, slot) for slot in spec.optimizer.slot_names]
    return keys + [STEP_COUNT]


@dataclass(frozen=True)
class Group:
    """This rank, the world size, and the process group the shards are spread over."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None


def checkpoint_state(container: str, tables: Mapping[str, TableSpec], shards: Mapping[str, Sequence[Shard]],
                     weights: Mapping[str, torch.Tensor], slots: Mapping[str, Mapping[str, torch.Tensor]],
                     step_count: int, where: Group) -> dict[str, torch.Tensor]:
    """The state of all ``tables`` from this rank's shards (``weights`` / ``slots``: its local
    pieces, by table). A collective when a table is row-wise over several ranks."""
    out = {}
    for name, spec in tables.items():
        out[weight_key(container, name)] = _to_checkpoint(spec, shards[name], weights.get(name), False, where)
        for slot in spec.optimizer.slot_names:
            out[slot_key(name, slot)] = _to_checkpoint(spec, shards[name], slots.get(name, {}).get(slot),
                                                       slot in spec.optimizer.row_slots, where)
    out[STEP_COUNT] = torch.tensor(step_count, dtype=torch.int64)
    return out


def local_state(container: str, tables: Mapping[str, TableSpec], shards: Mapping[str, Sequence[Shard]],
                state: Mapping[str, torch.Tensor], where: Group,
                ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], int]:
    """Inverse of :func:`checkpoint_state`: this rank's pieces (weights and slots by table, for the
    tables it holds) and the step count. A collective like it."""
    weights: dict[str, torch.Tensor] = {}
    slots: dict[str, dict[str, torch.Tensor]] = {}
    for name, spec in tables.items():
        piece = _from_checkpoint(spec, shards[name], state[weight_key(container, name)], where)
        if piece is not None:
            weights[name] = piece
        for slot in spec.optimizer.slot_names:
            piece = _from_checkpoint(spec, shards[name], state[slot_key(name, slot)], where)
            if piece is not None:
                slots.setdefault(name, {})[slot] = piece
    return weights, slots, int(state[STEP_COUNT])


def streamed_local_state(container: str, tables: Mapping[str, TableSpec], shards: Mapping[str, Sequence[Shard]],
                         state: Mapping[str, torch.Tensor]) -> tuple[TableTensors, TableTensors, int]:
    """:func:`local_state` on one rank whose table and slot tensors are read when asked (e.g.
    :class:`~torchrec_tpu.sharding.deferred.DeferredTensor` s reading a checkpoint): weights and
    slots as :class:`~sparsecore.backends.base.TableTensors`, each table's made from ``state`` when
    a backend loads it, so one table is held at a time."""
    def weight(name: str) -> torch.Tensor:
        return _own(shards[name], 0).slice(state[weight_key(container, name)])

    def table_slots(name: str) -> dict[str, torch.Tensor]:
        return {slot: _own(shards[name], 0).slice(state[slot_key(name, slot)])
                for slot in tables[name].optimizer.slot_names}

    shapes = {name: (spec.vocab_size, spec.dim) for name, spec in tables.items()}
    return (TableTensors(shapes, weight), TableTensors({name: () for name in tables}, table_slots),
            int(state[STEP_COUNT]))


def _own(shards: Sequence[Shard], rank: int) -> Shard | None:
    return next((s for s in shards if s.rank == rank), None)


def _to_checkpoint(spec: TableSpec, shards: Sequence[Shard], local: torch.Tensor | None, row_slot: bool,
                   where: Group) -> torch.Tensor:
    kind = shards[0].kind
    if where.world_size == 1 or kind == "data_parallel":
        return local
    if kind == "row_wise":
        local = _RowBlocks(spec.vocab_size, where).to_blocks(local)
    return _sharded(spec, shards, local, row_slot, where)


def _from_checkpoint(spec: TableSpec, shards: Sequence[Shard], saved: torch.Tensor,
                     where: Group) -> torch.Tensor | None:
    if not isinstance(saved, ShardedTensor):  # the whole table: one rank, data-parallel, or a plain state dict
        own = _own(shards, where.rank)
        return own.slice(saved) if own is not None else None
    (piece,) = [s.tensor for s in saved.local_shards()] or [None]
    if shards[0].kind == "row_wise":
        return _RowBlocks(spec.vocab_size, where).to_mod(piece)
    return piece


def _boxes(spec: TableSpec, shards: Sequence[Shard], row_slot: bool,
           where: Group) -> list[tuple[int, list[int], list[int]]]:
    """(rank, offsets, sizes) of each rank's piece in the checkpoint."""
    if shards[0].kind == "row_wise":
        bounds = _RowBlocks.bounds(spec.vocab_size, where.world_size)
        rows = [(r, bounds[r], bounds[r + 1] - bounds[r]) for r in range(where.world_size)]
        return [(r, [lo] if row_slot else [lo, 0], [n] if row_slot else [n, spec.dim]) for r, lo, n in rows]
    return [(s.rank, [s.column_block * spec.vocab_size] if row_slot else [0, s.col_offset],
             [spec.vocab_size] if row_slot else [spec.vocab_size, s.cols])
            for s in shards]


def _sharded(spec: TableSpec, shards: Sequence[Shard], piece: torch.Tensor | None, row_slot: bool,
             where: Group) -> ShardedTensor:
    boxes = _boxes(spec, shards, row_slot, where)
    metas = [ShardMetadata(offsets, sizes, f"rank:{_global_rank(r, where)}/cpu") for r, offsets, sizes in boxes]
    local = [TensorShard(piece.contiguous(), meta) for (r, _, _), meta in zip(boxes, metas) if r == where.rank]
    size = torch.Size([row_slot_size(spec, shards)] if row_slot else [spec.vocab_size, spec.dim])
    properties = TensorProperties(dtype=torch.float32, layout=torch.strided, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, ShardedTensorMetadata(metas, size, properties), process_group=where.group)


def _global_rank(rank: int, where: Group) -> int:
    return rank if where.group is None else dist.get_global_rank(where.group, rank)


class _RowBlocks:
    """A row-wise table over W ranks: rank r holds rows r, r + W, ... (the lookup layout) and, in
    the checkpoint, the contiguous block ``[bounds[r], bounds[r + 1])``."""

    @staticmethod
    def bounds(table_rows: int, world_size: int) -> list[int]:
        return [r * table_rows // world_size for r in range(world_size + 1)]

    def __init__(self, table_rows: int, where: Group):
        w, rank = where.world_size, where.rank
        self.group = where.group
        bounds = self.bounds(table_rows, w)
        mine = np.arange(rank, table_rows, w)  # global rows this rank holds, in local order
        self.sent_to = np.bincount(np.searchsorted(bounds, mine, side="right") - 1, minlength=w).tolist()
        lo, hi = bounds[rank], bounds[rank + 1]
        from_each = [np.arange(lo + (source - lo) % w, hi, w) for source in range(w)]  # rows of my block by holder
        self.received_from = [len(rows) for rows in from_each]
        self.positions = torch.from_numpy(np.concatenate(from_each) - lo)  # block row of each received row
        self.block_rows = hi - lo

    def to_blocks(self, local: torch.Tensor) -> torch.Tensor:
        width = math.prod(local.shape[1:])
        received = all_to_all(local.reshape(-1), [n * width for n in self.sent_to],
                              [n * width for n in self.received_from], self.group)
        block = local.new_empty((self.block_rows, *local.shape[1:]))
        block[self.positions] = received.view(-1, *local.shape[1:])
        return block

    def to_mod(self, block: torch.Tensor) -> torch.Tensor:
        width = math.prod(block.shape[1:])
        sent = block[self.positions].reshape(-1)
        received = all_to_all(sent, [n * width for n in self.received_from], [n * width for n in self.sent_to],
                              self.group)
        return received.view(-1, *block.shape[1:])
