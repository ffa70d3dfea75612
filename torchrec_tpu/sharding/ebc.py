"""``ShardedSparseCoreEBC``: a TorchRec-style sharded EmbeddingBagCollection on the sparsecore engine.

A KeyedJaggedTensor of this rank's batch goes in, a KeyedTensor of its pooled embeddings comes
out, like TorchRec's ``ShardedEmbeddingBagCollection``. In between:

1. input dist: the combiner is folded into per-id gains (as the SparseCore host does), ids are
   routed to the ranks holding their shard (row-wise: id mod W) and exchanged with uneven
   all_to_alls; every shard sees the global batch (ranks' samples in rank order);
2. each rank's shards run as one local sparsecore backend (lookup now, fused update in backward);
3. output dist: one all_to_all returns each rank's rows of every shard's output, which are placed
   (table/column-wise), summed (row-wise) or taken from the local replica (data-parallel).

Backward sends each shard the gradient of its output for all samples and applies the fused
optimizer there; no gradient of the tables ever materialises.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from sparsecore.optimizers import OptimizerSpec
from sparsecore.preprocess import combined_gains
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.torchrec_convert import configs_from_specs, specs_from_configs
from sparsecore.validation import FeatureInput, feature_inputs
from torchrec_tpu.sharding.batching import fixed_size_chunks
from torchrec_tpu.sharding.collectives import all_to_all
from torchrec_tpu.sharding.sharded_tables import ShardedTables, concat, torchrec_weights
from torchrec_tpu.sharding.shards import TableSharding


@dataclass
class LocalBatch:
    """What input dist delivers to this rank: global-batch inputs of its shards, by feature."""

    inputs: dict[str, FeatureInput]


class ShardedSparseCoreEBC(ShardedTables):
    """Pooled lookups of ``features`` (``batch_size`` = this rank's batch) over ``tables``, sharded
    over ``group`` (default: the world; no process group: one rank) as ``sharding`` says.

    ``weights`` are the full logical tables (identical on every rank); default: each table's
    ``TableSpec.init_weights(seed)``. Each table's ``optimizer`` is applied fused in backward.
    ``average_over_ranks`` divides the table gradients by the world size, as DDP averages the
    dense ones: with a per-rank mean loss, W ranks then train like one rank on the global batch.
    """

    def __init__(
        self,
        tables: Sequence[TableSpec],
        features: Sequence[FeatureSpec],
        sharding: Mapping[str, TableSharding],
        *,
        group: dist.ProcessGroup | None = None,
        topology: SparseCoreTopology = SparseCoreTopology(),
        backend: str = "xla",
        weights: Mapping[str, torch.Tensor] | None = None,
        seed: int = 0,
        id_policy: str = "error",
        average_over_ranks: bool = False,
        **backend_options: Any,
    ):
        super().__init__(tables, features, sharding, group, average_over_ranks)
        batch_sizes = {f.batch_size for f in features}
        if len(batch_sizes) != 1:
            raise ValueError(f"all features need one batch size for a KeyedTensor output, got {sorted(batch_sizes)}")
        self.batch_size = batch_sizes.pop()
        self.id_policy = id_policy
        self._offsets = dict(zip([f.name for f in features],
                                 np.cumsum([0] + [self.tables[f.table].dim for f in features]).tolist()))
        local_features = [FeatureSpec(f.name, f.table, self.batch_size * self.world_size, weighted=True)
                          for f, _ in self._served[self.rank]]
        self._backend = self._make_backend(local_features, topology, backend, weights, seed, backend_options)
        # input dists done ahead by a train pipeline: (the KJT's values tensor, its LocalBatch)
        self._prefetched: collections.deque[tuple[torch.Tensor, LocalBatch]] = collections.deque()
        self._prefetch_lock = threading.Lock()

    @classmethod
    def from_torchrec(cls, ebc: EmbeddingBagCollection, batch_size: int, sharding: Mapping[str, TableSharding],
                      optimizer: OptimizerSpec, **kwargs: Any) -> "ShardedSparseCoreEBC":
        """The same tables as TorchRec ``ebc`` (and its weights unless they are on the meta device)."""
        tables, features = specs_from_configs(ebc.embedding_bag_configs(), batch_size, optimizer=optimizer,
                                              weighted_features=ebc.is_weighted() and _all_features(ebc) or ())
        weights = torchrec_weights(ebc.embedding_bags)
        if weights:
            kwargs.setdefault("weights", weights)
        return cls(tables, features, sharding, **kwargs)

    def forward(self, kjt: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of ``kjt``'s samples. Other batch sizes than ``batch_size`` are padded
        (smaller) or, without grad, looked up in chunks (larger); every rank must make the same
        calls, as the dists are collectives."""
        if kjt.stride() == self.batch_size:
            return self.compute_and_output_dist(self._take_prefetched(kjt) or self.input_dist(kjt))
        if kjt.stride() > self.batch_size and torch.is_grad_enabled():
            raise ValueError(f"a training batch of {kjt.stride()} samples exceeds the EBC's batch_size "
                             f"{self.batch_size} (per rank); evaluate larger batches under torch.no_grad()")
        parts = [self.compute_and_output_dist(self.input_dist(chunk)).values()[:real]
                 for chunk, real in fixed_size_chunks(kjt, self.batch_size)]
        return KeyedTensor(keys=[f.name for f in self.features],
                           length_per_key=[self.tables[f.table].dim for f in self.features], values=torch.cat(parts))

    def prefetch(self, kjt: KeyedJaggedTensor, group: dist.ProcessGroup | None = None) -> None:
        """Run the input dist of a coming batch now (e.g. on a pipeline thread, over its own
        ``group`` so its collectives never interleave with the step's); ``forward`` of the same
        KJT then starts from the result. Batches must be consumed in prefetch order."""
        batch = self.input_dist(kjt, group)
        with self._prefetch_lock:
            self._prefetched.append((kjt.values(), batch))

    def _take_prefetched(self, kjt: KeyedJaggedTensor) -> LocalBatch | None:
        """The prefetched input of ``kjt``, dropping older ones never used (skipped batches);
        other KJTs (evaluation batches) leave the queue alone."""
        with self._prefetch_lock:
            for i, (values, batch) in enumerate(self._prefetched):
                if values is kjt.values():
                    for _ in range(i + 1):
                        self._prefetched.popleft()
                    return batch
        return None

    def input_dist(self, kjt: KeyedJaggedTensor, group: dist.ProcessGroup | None = None) -> LocalBatch:
        """Validate ``kjt`` (errors name the feature), fold combiners into gains, exchange ids
        (over ``group``, default the EBC's)."""
        group = group if group is not None else self.group
        inputs = feature_inputs(kjt, self.features, self.tables, self.id_policy)
        lengths, ids, gains = [], [], []
        for served in self._served:
            for f, shard in served:
                x = inputs[f.name]
                sample = np.repeat(np.arange(x.lengths.size), x.lengths)
                gain = combined_gains(x.weights, x.lengths, sample, self.tables[f.table].combiner)
                keep = shard.owns(x.ids)
                lengths.append(np.bincount(sample[keep], minlength=x.lengths.size))
                ids.append(shard.local_rows(x.ids[keep]))
                gains.append(gain[keep])
        b = self.batch_size
        send_lengths = torch.from_numpy(np.concatenate(lengths).astype(np.int64)) if lengths else torch.zeros(0, dtype=torch.int64)
        counts = [len(s) * b for s in self._served]
        recv_lengths = all_to_all(send_lengths, counts, [len(self._served[self.rank]) * b] * self.world_size,
                                  group).numpy()
        id_counts = self._per_destination([len(a) for a in ids])
        per_source = recv_lengths.reshape(self.world_size, -1)
        recv_counts = per_source.sum(axis=1).tolist()
        recv_ids = all_to_all(concat(ids, np.int64), id_counts, recv_counts, group).numpy()
        recv_gains = all_to_all(concat(gains, np.float32), id_counts, recv_counts, group).numpy()
        return LocalBatch(self._assemble_inputs(per_source, recv_ids, recv_gains))

    def _assemble_inputs(self, per_source: np.ndarray, ids: np.ndarray, gains: np.ndarray) -> dict[str, FeatureInput]:
        """Per served feature: the global batch, source ranks' samples in rank order."""
        served = self._served[self.rank]
        b = self.batch_size
        pieces: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {f.name: [] for f, _ in served}
        start = 0
        for source in range(self.world_size):
            for j, (f, _) in enumerate(served):
                lengths = per_source[source, j * b:(j + 1) * b]
                stop = start + int(lengths.sum())
                pieces[f.name].append((lengths, ids[start:stop], gains[start:stop]))
                start = stop
        return {name: FeatureInput(np.concatenate([p[1] for p in parts]), np.concatenate([p[0] for p in parts]),
                                   np.concatenate([p[2] for p in parts]))
                for name, parts in pieces.items()}

    def compute_and_output_dist(self, batch: LocalBatch) -> KeyedTensor:
        """Look up the local shards and return this rank's pooled embeddings."""
        values = self._looked_up(batch)
        return KeyedTensor(keys=[f.name for f in self.features],
                           length_per_key=[self.tables[f.table].dim for f in self.features], values=values)

    def _lookup(self, batch: LocalBatch) -> tuple[dict[str, torch.Tensor], Any]:
        return self._backend.forward(batch.inputs) if self._backend else ({}, None)

    def _output_dist(self, activations: dict[str, torch.Tensor]) -> torch.Tensor:
        b, served = self.batch_size, self._served
        send = torch.cat([activations[f.name][r * b:(r + 1) * b].reshape(-1)
                          for r in range(self.world_size) for f, _ in served[self.rank]] or [torch.zeros(0)])
        mine = b * sum(s.cols for _, s in served[self.rank])
        recv = all_to_all(send, [mine] * self.world_size, [b * sum(s.cols for _, s in p) for p in served], self.group)
        out = torch.zeros(b, self._offsets[self.features[-1].name] + self.tables[self.features[-1].table].dim)
        start = 0
        for source, pairs in enumerate(served):
            for f, shard in pairs:
                block = recv[start:start + b * shard.cols].view(b, shard.cols)
                start += b * shard.cols
                cols = slice(self._offsets[f.name] + shard.col_offset, self._offsets[f.name] + shard.col_offset + shard.cols)
                if shard.kind == "row_wise":
                    out[:, cols] += block
                elif shard.kind != "data_parallel" or source == self.rank:
                    out[:, cols] = block
        return out

    def _update(self, context: Any, grad: torch.Tensor) -> None:
        """Send every shard the gradient of its output for this rank's samples; apply the update."""
        b, served = self.batch_size, self._served
        parts = [grad[:, self._offsets[f.name] + s.col_offset:self._offsets[f.name] + s.col_offset + s.cols].reshape(-1)
                 for pairs in served for f, s in pairs]
        mine = b * sum(s.cols for _, s in served[self.rank])
        recv = all_to_all(torch.cat(parts or [torch.zeros(0)]), [b * sum(s.cols for _, s in p) for p in served],
                          [mine] * self.world_size, self.group).view(self.world_size, -1)
        if self._backend is None:
            return
        grads, start = {}, 0
        for f, shard in served[self.rank]:
            width = b * shard.cols
            grads[f.name] = recv[:, start:start + width].reshape(self.world_size * b, shard.cols)
            start += width
        self._backend.backward(context, grads)

    def to_torchrec(self) -> EmbeddingBagCollection:
        """A plain CPU TorchRec EBC holding the current tables, for serving (a collective)."""
        ebc = EmbeddingBagCollection(tables=configs_from_specs(list(self.tables.values()), self.features),
                                     device=torch.device("cpu"))
        self._copy_unsharded_into(ebc.embedding_bags)
        return ebc


def _all_features(ebc: EmbeddingBagCollection) -> list[str]:
    return [name for config in ebc.embedding_bag_configs() for name in config.feature_names]
