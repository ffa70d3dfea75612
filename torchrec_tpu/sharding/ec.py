"""``ShardedSparseCoreEC``: a TorchRec-style sharded EmbeddingCollection (sequence embeddings: one
row per id, no pooling) on the sparsecore engine.

A KeyedJaggedTensor of this rank's batch goes in, a dict feature -> JaggedTensor comes out
(values [ids, dim], the KJT's lengths), like TorchRec's ``EmbeddingCollection``. In between:

1. input dist: every id goes to the ranks holding its shard (row-wise: id mod W; data-parallel:
   every replica, so all replicas apply the same update) with uneven all_to_alls;
2. each rank deduplicates the ids it received per feature and looks them up on its local
   sparsecore backend as a batch of one-id samples (a pooled lookup of bags of one id is a
   sequence lookup); the batch is padded to a capacity that grows, keeping the tables and slots,
   when a step brings more unique ids than it holds;
3. output dist: every id's row (its column block, column-wise) returns to the id's rank.

Backward returns every id's gradient to its shards, sums it per unique id (scatter-add) and
applies the fused optimizer once per touched row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torchrec import EmbeddingCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from sparsecore.optimizers import OptimizerSpec
from sparsecore.specs import FeatureSpec, TableSpec
from sparsecore.torchrec_convert import configs_from_specs, specs_from_configs
from sparsecore.validation import FeatureInput, feature_inputs
from torchrec_tpu.sharding.collectives import all_to_all
from torchrec_tpu.sharding.sharded_tables import ShardedTables, concat, features_at
from torchrec_tpu.sharding.shards import Shard, TableSharding
from torchrec_tpu.sharding.zch import ZchSpec
from tpu_facts import global_batch_of, power_of_two_bucket, round_up

NO_ZCH = ("ShardedSparseCoreEC does not remap raw ids (managed collisions run on ShardedSparseCoreEBC's pooled "
          "tables only); give the sequence tables ids below their rows")


@dataclass
class SequenceBatch:
    """One step's input dist. This rank's side: the KJT's features (the outputs' layout) and
    ``sent[d][j]``, the positions in its feature's ids of the ids sent for pair j of rank d. The
    serving side: ``unique`` local rows per served feature, and ``inverse[s][j]``, the index in
    ``unique`` of every id received from rank s for served pair j."""

    features: dict[str, JaggedTensor]
    sent: list[list[np.ndarray]]
    unique: dict[str, np.ndarray]
    inverse: list[list[np.ndarray]]


@dataclass
class _Lookup:
    """The local lookup of one step: activations of every unique id, by served feature; the
    activation row of every id received, ``id_rows[s][j]`` for served pair j from rank s; the
    backend's context for the update."""

    activations: dict[str, torch.Tensor]
    id_rows: list[list[torch.Tensor]]
    context: Any


class ShardedSparseCoreEC(ShardedTables):
    """Sequence lookups of ``features`` over ``tables``, sharded over ``group`` (default: the
    world; no process group: one rank) as ``sharding`` says; any batch size per call; the other
    options (weights, local engine, ``average_over_ranks``) are :class:`ShardedTables`'.

    A feature's ``batch_size`` (per rank) and ``max_ids_per_sample`` only size the first lookup
    buffers. ``need_indices`` puts each feature's ids into its output's weights, as TorchRec does.
    """

    table_modules = "embeddings"

    def __init__(self, tables: Sequence[TableSpec], features: Sequence[FeatureSpec],
                 sharding: Mapping[str, TableSharding], *, need_indices: bool = False, **options: Any):
        super().__init__(tables, features, sharding, **options)
        self.need_indices = need_indices

    def _configure(self) -> None:
        n = self.engine.topology.num_sparsecores
        ids = {f.name: global_batch_of(self.local_batch, self.world_size) * (f.max_ids_per_sample or 1)
               for f, _ in self._served[self.rank]}
        self._capacity = {f.name: round_up(min(ids[f.name], shard.rows), n) for f, shard in self._served[self.rank]}

    @classmethod
    def from_torchrec(cls, ec: EmbeddingCollection, sharding: Mapping[str, TableSharding], optimizer: OptimizerSpec,
                      batch_size: int = 1, **kwargs: Any) -> "ShardedSparseCoreEC":
        """The same tables as TorchRec ``ec`` (and its weights unless they are on the meta device);
        ``batch_size``: the expected per-rank batch (sizes the first lookup buffers). A
        managed-collision ``ec`` (MC-EC) is refused: see :meth:`manage_collisions`."""
        if isinstance(ec, ManagedCollisionEmbeddingCollection):
            names = sorted(ec._managed_collision_collection._managed_collision_modules)
            raise ValueError(f"a ManagedCollisionEmbeddingCollection (zch tables {names}): {NO_ZCH}")
        tables, features = specs_from_configs(ec.embedding_configs(), batch_size, optimizer=optimizer)
        kwargs.setdefault("need_indices", ec.need_indices())
        return cls._from_torchrec_modules(tables, features, ec.embeddings, sharding, **kwargs)

    def manage_collisions(self, specs: Mapping[str, ZchSpec]) -> None:
        """Refused for any table (none: nothing to do): :data:`NO_ZCH`."""
        if specs:
            raise ValueError(f"zch tables {sorted(specs)}: {NO_ZCH}")

    def _local_features(self, rank: int) -> list[FeatureSpec]:
        """Each served feature as a batch of ``capacity`` one-id samples."""
        return [FeatureSpec(f.name, f.table, self._capacity[f.name], weighted=True) for f, _ in self._served[rank]]

    def _local_tables(self, rank: int) -> dict[str, TableSpec]:
        """The served shards with partition limits no batch can exceed: all ids of one source
        SparseCore's samples may go to one partition."""
        n = self.engine.topology.num_sparsecores
        per_chunk: dict[str, int] = {}
        for f, _ in self._served[rank]:
            per_chunk[f.table] = per_chunk.get(f.table, 0) + self._capacity[f.name] // n
        specs = {}
        for f, shard in self._served[rank]:
            spec = shard.local_spec(self.tables[f.table])
            limit = max(spec.max_ids_per_partition, per_chunk[f.table])
            specs[f.table] = replace(spec, max_ids_per_partition=limit, max_unique_ids_per_partition=limit)
        return specs

    def forward(self, kjt: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """Every id's embedding, by feature; every rank must make the same calls (the dists are
        collectives)."""
        return self.compute_and_output_dist(self.input_dist(kjt))

    def input_dist(self, kjt: KeyedJaggedTensor) -> SequenceBatch:
        """Validate ``kjt`` (errors name the feature) and send every id to its shards."""
        specs = features_at(self.features, kjt.stride())  # this batch's samples: any size may come
        inputs = feature_inputs(kjt, specs, self.tables, self.engine.id_policy)
        sent, ids = [], []
        for pairs in self._served:
            positions = [np.flatnonzero(shard.owns(inputs[f.name].ids)) for f, shard in pairs]
            sent.append(positions)
            ids.extend(shard.local_rows(inputs[f.name].ids[p]) for (f, shard), p in zip(pairs, positions))
        mine = len(self._served[self.rank])
        counts = all_to_all(torch.tensor([len(a) for a in ids], dtype=torch.int64), [len(p) for p in self._served],
                            [mine] * self.world_size, self.group).view(self.world_size, mine).numpy()
        recv = all_to_all(concat(ids, np.int64), self._per_destination([len(a) for a in ids]),
                          counts.sum(axis=1).tolist(), self.group).numpy()
        blocks = np.split(recv, np.cumsum(counts.reshape(-1))[:-1])
        unique, inverse = {}, [[None] * mine for _ in range(self.world_size)]
        for j, (f, shard) in enumerate(self._served[self.rank]):
            per_source = [blocks[s * mine + j] for s in range(self.world_size)]
            unique[f.name], all_inverse = _unique_rows(np.concatenate(per_source), shard.rows)
            for s, part in enumerate(np.split(all_inverse, np.cumsum([len(b) for b in per_source])[:-1])):
                inverse[s][j] = part
        return SequenceBatch(kjt.to_dict(), sent, unique, inverse)

    def compute_and_output_dist(self, batch: SequenceBatch) -> dict[str, JaggedTensor]:
        """Look up the local shards and return this rank's embeddings, by feature."""
        values = self._by_feature(batch, self._looked_up(batch))
        return {name: JaggedTensor(values=v, lengths=batch.features[name].lengths(),
                                   weights=batch.features[name].values() if self.need_indices else None)
                for name, v in values.items()}

    def _value_sizes(self, batch: SequenceBatch) -> list[int]:
        """Floats of each feature's output values, in feature order."""
        return [batch.features[f.name].values().numel() * self.tables[f.table].dim for f in self.features]

    def _by_feature(self, batch: SequenceBatch, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views [ids, dim] of each feature's part of ``flat`` (one split: its backward
        concatenates the features' gradients once)."""
        return {f.name: part.view(-1, self.tables[f.table].dim)
                for f, part in zip(self.features, flat.split(self._value_sizes(batch)))}

    def _lookup_and_output_dist(self, batch: SequenceBatch) -> tuple[torch.Tensor, tuple[SequenceBatch, _Lookup]]:
        lookup = self._lookup(batch)
        flat = torch.empty(sum(self._value_sizes(batch)))  # the shards' blocks cover every value
        values = self._by_feature(batch, flat)
        if self.world_size == 1:  # no collective: each block gathered straight into its place
            for j, (f, shard) in enumerate(self._served[0]):
                _gather_into(values[f.name], _block_index(batch.sent[0][j], values[f.name].shape[0], shard),
                             lookup.activations[f.name], lookup.id_rows[0][j])
            return flat, (batch, lookup)
        send = [lookup.activations[f.name].index_select(0, lookup.id_rows[s][j]).reshape(-1)
                for s in range(self.world_size) for j, (f, _) in enumerate(self._served[self.rank])]
        recv = all_to_all(torch.cat(send or [torch.zeros(0)]), self._served_sizes(batch), self._sent_sizes(batch),
                          self.group)
        start = 0
        for rank, pairs in enumerate(self._served):
            for j, (f, shard) in enumerate(pairs):
                block = recv[start:start + batch.sent[rank][j].size * shard.cols].view(-1, shard.cols)
                start += block.numel()
                if shard.kind != "data_parallel" or rank == self.rank:
                    values[f.name][_block_index(batch.sent[rank][j], values[f.name].shape[0], shard)] = block
        return flat, (batch, lookup)

    def _lookup(self, batch: SequenceBatch) -> _Lookup:
        """Grow the capacity if needed, then look up every served feature's unique rows."""
        if self._backend is None:
            return _Lookup({}, [], None)
        self._fit({name: ids.size for name, ids in batch.unique.items()})
        n = self.engine.topology.num_sparsecores
        inputs, rows = {}, {}
        for name, ids in batch.unique.items():
            capacity = self._capacity[name]
            j = np.arange(ids.size)
            rows[name] = (j % n) * (capacity // n) + j // n  # spread over the SparseCores' sample chunks
            order = np.concatenate([j[k::n] for k in range(n)])  # (the rows' ascending order)
            lengths = np.zeros(capacity, dtype=np.int64)
            lengths[rows[name]] = 1
            inputs[name] = FeatureInput(ids[order], lengths, np.ones(ids.size, dtype=np.float32))
        activations, context = self._backend.forward(inputs)
        id_rows = [[torch.from_numpy(rows[f.name][batch.inverse[s][j]])
                    for j, (f, _) in enumerate(self._served[self.rank])]
                   for s in range(self.world_size)]
        return _Lookup(activations, id_rows, context)

    def _fit(self, unique: Mapping[str, int]) -> None:
        """Rebuild the backend with room for ``unique`` ids per feature, keeping its state."""
        short = {name: count for name, count in unique.items() if count > self._capacity[name]}
        if not short:
            return
        n = self.engine.topology.num_sparsecores
        rows = {f.name: shard.rows for f, shard in self._served[self.rank]}
        for name, count in short.items():  # powers of two: few rebuilds (each compiles anew)
            self._capacity[name] = round_up(min(max(power_of_two_bucket(count), 2 * self._capacity[name]),
                                                rows[name]), n)
        old = self._backend
        weights = old.table_weights()
        self._backend = self.engine.make(list(self._local_tables(self.rank).values()), self._local_features(self.rank),
                                         weights)
        self._backend.load_state(weights, old.optimizer_slots(), old.steps)

    def _served_sizes(self, batch: SequenceBatch) -> list[int]:
        """Floats of embeddings this rank returns to each rank (its received ids x shard columns)."""
        return [sum(len(batch.inverse[s][j]) * shard.cols for j, (_, shard) in enumerate(self._served[self.rank]))
                for s in range(self.world_size)]

    def _sent_sizes(self, batch: SequenceBatch) -> list[int]:
        """Floats of embeddings each rank returns to this one (the ids sent to it x shard columns)."""
        return [sum(len(batch.sent[r][j]) * shard.cols for j, (_, shard) in enumerate(pairs))
                for r, pairs in enumerate(self._served)]

    def _update(self, context: tuple[SequenceBatch, _Lookup], grad: torch.Tensor) -> None:
        """Send every id's gradient to its shards, sum it per unique id, apply the update."""
        batch, lookup = context
        grads = self._by_feature(batch, grad)
        served = self._served[self.rank]
        if self.world_size == 1:  # no collective: each block summed straight from the gradient
            blocks = [[grads[f.name][_block_index(batch.sent[0][j], grads[f.name].shape[0], shard)]
                       for j, (f, shard) in enumerate(served)]]
        else:
            send = [grads[f.name][_block_index(batch.sent[r][j], grads[f.name].shape[0], shard)].reshape(-1)
                    for r, pairs in enumerate(self._served) for j, (f, shard) in enumerate(pairs)]
            recv = all_to_all(torch.cat(send or [torch.zeros(0)]), self._sent_sizes(batch),
                              self._served_sizes(batch), self.group)
            sizes = [len(batch.inverse[s][j]) * shard.cols for s in range(self.world_size)
                     for j, (_, shard) in enumerate(served)]
            parts = iter(recv.split(sizes))
            blocks = [[next(parts).view(-1, shard.cols) for _, shard in served] for _ in range(self.world_size)]
        if self._backend is None:  # this rank serves no table (it still took part in the exchange)
            return
        summed = {f.name: torch.zeros(self._capacity[f.name], shard.cols) for f, shard in served}
        for rows, received in zip(lookup.id_rows, blocks):
            for (f, _), r, block in zip(served, rows, received):
                summed[f.name].index_add_(0, r, block)
        self._backend.backward(lookup.context, summed)

    def to_torchrec(self) -> EmbeddingCollection:
        """A plain CPU TorchRec EmbeddingCollection holding the current tables (a collective)."""
        ec = EmbeddingCollection(tables=configs_from_specs(list(self.tables.values()), self.features, pooled=False),
                                 device=torch.device("cpu"), need_indices=self.need_indices)
        self._copy_unsharded_into(ec.embeddings)
        return ec


def _unique_rows(rows: np.ndarray, table_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(rows, return_inverse=True)`` of rows in [0, ``table_rows``): by a mark per table
    row (no sort) where the table is small next to the batch."""
    if table_rows > 8 * rows.size:
        return np.unique(rows, return_inverse=True)
    seen = np.zeros(table_rows, dtype=bool)
    seen[rows] = True
    return np.flatnonzero(seen), (np.cumsum(seen) - 1)[rows]


def _gather_into(out: torch.Tensor, index: tuple[slice | torch.Tensor, slice], activations: torch.Tensor,
                 rows: torch.Tensor) -> None:
    """``out[index] = activations[rows]``, written in place where ``index`` is all of ``out``."""
    if isinstance(index[0], slice) and index[1].stop - index[1].start == out.shape[1]:
        torch.index_select(activations, 0, rows, out=out)
    else:
        out[index] = activations.index_select(0, rows)


def _block_index(positions: np.ndarray, ids: int, shard: Shard) -> tuple[slice | torch.Tensor, slice]:
    """Where a shard's block of ``positions`` lies in its feature's [ids, dim] values (plain
    slices when it holds every id: no gather or scatter copies)."""
    rows = slice(None) if positions.size == ids else torch.from_numpy(positions)
    return rows, slice(shard.col_offset, shard.col_offset + shard.cols)
