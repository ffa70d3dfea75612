"""``ManagedCollisions``: a sharded module's managed-collision remap and what it owes the tables.

A batch's raw ids travel to the ranks that own their slots in its input dist (on the prefetch
thread when there is one) and are remapped there, on the host, so every lookup, the one-program
step's included, sees slots in range. As in TorchRec's sharded MC-EBC, each row-wise shard of a
table has its own remap over the shard's rows (its sorted identity table, metadata and history),
fed the ids :func:`~torchrec_tpu.sharding.zch.owner_ranks` routes to it, global batch in rank
order; a shard holding all of a table's rows (one rank, table-, column-wise or a replica) remaps
every id of the global batch, each alike. The slots a
batch's remap evicted travel with it (:class:`ZchBatch`) and are reset just before its lookup,
after the previous batch's update, where TorchRec's sharded MC-EBC resets them: the rows are drawn
afresh from the table's initializer and the optimizer state goes back to its initial values
(TorchRec zeroes the momentum, then applies the table's ``init_fn``). The remap state a
checkpoint saves is the one after the last batch the tables trained on, however far the prefetch
thread has remapped ahead.
"""

from __future__ import annotations

import dataclasses
import io
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torchrec.modules.mc_modules import MCHManagedCollisionModule

from sparsecore.validation import FeatureInput
from torchrec_tpu.sharding.zch import RemapMark, ZchSpec, owner_ranks, torchrec_state
from torchrec_tpu.sharding.zch_collection import ZchCollection

if TYPE_CHECKING:
    from torchrec_tpu.sharding.sharded_tables import ShardedTables

STATE_KEY = "zch_state"  # the module's state dict entry: the remap state, serialized (plain tensors)


def state_key(rank: int, world_size: int) -> str:
    """The state dict entry of ``rank``'s remap state (one rank: :data:`STATE_KEY`; several:
    one entry per rank, as each holds the remaps of its own shards)."""
    return STATE_KEY if world_size == 1 else f"{STATE_KEY}.rank{rank}_of_{world_size}"


@dataclass(frozen=True)
class ZchBatch:
    """What a batch's remap left for its lookup: the slots each table ``evicted`` and the remap
    state after it (``marks``; None for a frozen remap, which changes nothing)."""

    evicted: dict[str, torch.Tensor]
    marks: dict[str, RemapMark] | None


class ManagedCollisions:
    """The remap of ``module``'s ``specs`` tables (name -> :class:`ZchSpec`): of this rank's shards."""

    def __init__(self, module: "ShardedTables", specs: Mapping[str, ZchSpec]):
        unknown = sorted(set(specs) - set(module.tables))
        if unknown:
            raise ValueError(f"zch tables {unknown} are not among the tables {sorted(module.tables)}")
        served = {shard.table: shard for _, shard in module._served[module.rank] if shard.table in specs}
        features = {name: [f.name for f in module.features if f.table == name] for name in served}
        self.collection = ZchCollection({name: (shard.rows, specs[name]) for name, shard in served.items()}, features)
        self.module, self.shards, self._specs = module, served, dict(specs)
        self._trained: dict[str, RemapMark] | None = None

    @property
    def specs(self) -> dict[str, ZchSpec]:
        return dict(self._specs)

    @property
    def raw_features(self) -> frozenset[str]:
        """The features whose ids are raw (remapped after the input dist)."""
        return frozenset(f.name for f in self.module.features if f.table in self._specs)

    def owners(self, table: str, ids: np.ndarray) -> np.ndarray | None:
        """The rank each raw id of ``table`` goes to when the table is row-wise over several
        ranks (:func:`owner_ranks`); None when every shard of it takes every id."""
        shards = self.module.shards[table]
        if table not in self._specs or shards[0].kind != "row_wise" or len(shards) == 1:
            return None
        return owner_ranks(torch.from_numpy(ids), self._specs[table].input_hash_size, len(shards)).numpy()

    def remap(self, received: Mapping[str, FeatureInput], training: bool) -> tuple[dict[str, FeatureInput], ZchBatch]:
        """``received`` (this rank's shards' inputs, global batch) with the managed ids as local
        rows; ``training`` counts them toward the policy."""
        ids = {name: torch.from_numpy(x.ids) for name, x in received.items()}
        slots, evicted = self.collection.remap_ids(ids, training)
        out = {name: dataclasses.replace(x, ids=slots[name].numpy()) if name in slots else x
               for name, x in received.items()}
        rows = {table: self.shards[table].row_offset + local * self.shards[table].row_stride
                for table, local in evicted.items()}
        return out, ZchBatch(rows, self.collection.marks() if training else None)

    def settle(self, batch: ZchBatch | None) -> None:
        """Before ``batch``'s lookup: reset the rows it evicted; its remap state is now the trained one."""
        if batch is None or batch.marks is None:
            return
        if batch.evicted:
            reset_rows(self.module, batch.evicted, {t: m.iteration for t, m in batch.marks.items()})
        self._trained = batch.marks

    def state_bytes(self) -> bytes:
        """The trained remap state (:meth:`ZchCollection.state_dict`), serialized."""
        buffer = io.BytesIO()
        torch.save(self.collection.state_dict(self._trained), buffer)
        return buffer.getvalue()

    def load_torchrec(self, modules: Mapping[str, MCHManagedCollisionModule]) -> None:
        """Take the remap state of live (unsharded) TorchRec modules, by table (:func:`torchrec_state`)."""
        if self.module.world_size > 1:
            raise ValueError(f"zch: the state of unsharded TorchRec MCH modules loads on one rank, not "
                             f"{self.module.world_size}")
        for name, module in modules.items():
            self.collection.remaps[name].load_state_dict(torchrec_state(module))
        self._trained = None

    def load_bytes(self, data: bytes) -> None:
        """Install a :meth:`state_bytes`."""
        load_state_bytes(self.collection, data)
        self._trained = None


def load_state_bytes(collection: ZchCollection, data: bytes) -> None:
    """Install a :meth:`ManagedCollisions.state_bytes` into ``collection`` (plain tensors only are read)."""
    state = torch.load(io.BytesIO(data), weights_only=True) if isinstance(data, bytes) else None
    if not isinstance(state, dict):
        raise ValueError(f"the zch state in the checkpoint is not a dict of tensors ({type(data).__name__})")
    collection.load_state_dict(state)


def reset_rows(module: "ShardedTables", rows: Mapping[str, torch.Tensor], iterations: Mapping[str, int]) -> None:
    """Reset ``rows`` (table -> global rows) of ``module``'s local shards: weights drawn from the
    table's initializer (seeded by the module's seed, the table and ``iterations[table]``, the
    remap iteration that evicted them: the same rows on every rank and in a resumed run),
    optimizer slots at their initial values."""
    backend = module.local_backend
    served = {shard.table: shard for _, shard in module._served[module.rank]}
    rows = {table: r for table, r in rows.items() if table in served and r.numel()}
    if backend is None or not rows:
        return
    for table, global_rows in rows.items():
        spec, shard = module.tables[table], served[table]
        generator = torch.Generator().manual_seed(module.engine.seed * 1_000_003 + zlib.crc32(table.encode())
                                                  + 7919 * iterations[table])
        fresh = spec.effective_initializer.sample(global_rows.numel(), spec.dim, generator)
        ids = global_rows.numpy()
        mine = shard.owns(ids)
        local = torch.from_numpy(shard.local_rows(ids[mine]))
        fresh = fresh[torch.from_numpy(mine)][:, shard.col_offset:shard.col_offset + shard.cols]
        backend.reset_rows(table, local, fresh, spec.optimizer.slot_initial_values())
