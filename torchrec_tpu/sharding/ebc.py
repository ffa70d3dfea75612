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
from torch import nn
from torchrec import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from sparsecore.backends import make_backend
from sparsecore.optimizers import OptimizerSpec
from sparsecore.preprocess import combined_gains
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec, validate_specs
from sparsecore.stacking import plan_stacking
from sparsecore.torchrec_convert import configs_from_specs, specs_from_configs
from sparsecore.validation import FeatureInput, feature_inputs
from torchrec_tpu.sharding.batching import fixed_size_chunks
from torchrec_tpu.sharding.collectives import all_to_all
from torchrec_tpu.sharding.shards import Shard, TableSharding, make_shards
from torchrec_tpu.sharding.state_dict import Group, checkpoint_state, local_state, state_keys


@dataclass
class LocalBatch:
    """What input dist delivers to this rank: global-batch inputs of its shards, by feature."""

    inputs: dict[str, FeatureInput]


class _ShardedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, ebc: "ShardedSparseCoreEBC", batch: LocalBatch) -> torch.Tensor:
        activations, ctx.context = ebc._lookup(batch)
        ctx.ebc = ebc
        return ebc._output_dist(activations)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        ctx.ebc._update(ctx.context, (grad * ctx.ebc._grad_scale).contiguous())
        return None, None, None


class ShardedSparseCoreEBC(nn.Module):
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
        super().__init__()
        self.tables = validate_specs(tables, features)
        batch_sizes = {f.batch_size for f in features}
        if len(batch_sizes) != 1:
            raise ValueError(f"all features need one batch size for a KeyedTensor output, got {sorted(batch_sizes)}")
        self.batch_size = batch_sizes.pop()
        self.features = list(features)
        self.group = group
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if distributed else 0
        self.world_size = dist.get_world_size(group) if distributed else 1
        self.id_policy = id_policy
        self._grad_scale = 1.0 / self.world_size if average_over_ranks else 1.0
        self.steps = 0  # fused updates applied (counted on every rank, with or without local shards)
        self.shards = make_shards(tables, sharding, self.world_size)
        # (feature, shard) pairs each rank serves, in feature order: the layout of every message
        self._served = [[(f, s) for f in self.features for s in self.shards[f.table] if s.rank == r]
                        for r in range(self.world_size)]
        self._offsets = dict(zip([f.name for f in features],
                                 np.cumsum([0] + [self.tables[f.table].dim for f in features]).tolist()))
        self._backend = self._local_backend(topology, backend, weights, seed, backend_options)
        # input dists done ahead by a train pipeline: (the KJT's values tensor, its LocalBatch)
        self._prefetched: collections.deque[tuple[torch.Tensor, LocalBatch]] = collections.deque()
        self._prefetch_lock = threading.Lock()
        self._anchor = nn.Parameter(torch.empty(0), requires_grad=True)  # makes autograd call backward

    @classmethod
    def from_torchrec(cls, ebc: EmbeddingBagCollection, batch_size: int, sharding: Mapping[str, TableSharding],
                      optimizer: OptimizerSpec, **kwargs: Any) -> "ShardedSparseCoreEBC":
        """The same tables as TorchRec ``ebc`` (and its weights unless they are on the meta device)."""
        tables, features = specs_from_configs(ebc.embedding_bag_configs(), batch_size, optimizer=optimizer,
                                              weighted_features=ebc.is_weighted() and _all_features(ebc) or ())
        weights = {name: bag.weight.detach().cpu() for name, bag in ebc.embedding_bags.items()
                   if not bag.weight.is_meta}
        if weights:
            kwargs.setdefault("weights", weights)
        return cls(tables, features, sharding, **kwargs)

    def _local_backend(self, topology, backend, weights, seed, options):
        served = self._served[self.rank]
        if not served:
            return None
        mine = {s.table: s for _, s in served}
        full = weights if weights is not None else {name: self.tables[name].init_weights(seed) for name in mine}
        local_tables = [s.local_spec(self.tables[name]) for name, s in mine.items()]
        local_features = [FeatureSpec(f.name, f.table, self.batch_size * self.world_size, weighted=True)
                          for f, _ in served]
        plan = plan_stacking(local_tables, local_features, topology)
        return make_backend(backend, plan, {name: s.slice(full[name]) for name, s in mine.items()}, seed, **options)

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
        recv_ids = all_to_all(_cat(ids, np.int64), id_counts, recv_counts, group).numpy()
        recv_gains = all_to_all(_cat(gains, np.float32), id_counts, recv_counts, group).numpy()
        return LocalBatch(self._assemble_inputs(per_source, recv_ids, recv_gains))

    def _per_destination(self, sizes: list[int]) -> list[int]:
        out, i = [], 0
        for served in self._served:
            out.append(sum(sizes[i:i + len(served)]))
            i += len(served)
        return out

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
        if torch.is_grad_enabled():
            values = _ShardedLookup.apply(self._anchor, self, batch)
        else:
            values = self._output_dist(self._lookup(batch)[0])
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
        self.steps += 1
        if self._backend is None:
            return
        grads, start = {}, 0
        for f, shard in served[self.rank]:
            width = b * shard.cols
            grads[f.name] = recv[:, start:start + width].reshape(self.world_size * b, shard.cols)
            start += width
        self._backend.backward(context, grads)

    def unsharded_weights(self) -> dict[str, torch.Tensor]:
        """Full [vocab, dim] weights of every table, on every rank (a collective; copies)."""
        return self._gather(lambda backend: backend.table_weights())

    def unsharded_slots(self) -> dict[str, dict[str, torch.Tensor]]:
        """Full optimizer slots of every table by slot name, on every rank (a collective)."""
        slots = self._gather(lambda backend: {f"{t}\0{k}": v for t, d in backend.optimizer_slots().items()
                                              for k, v in d.items()}, keyed_slots=True)
        out: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in slots.items():
            table, slot = key.split("\0")
            out.setdefault(table, {})[slot] = value
        return out

    def to_torchrec(self) -> EmbeddingBagCollection:
        """A plain CPU TorchRec EBC holding the current tables, for serving (a collective)."""
        ebc = EmbeddingBagCollection(tables=configs_from_specs(list(self.tables.values()), self.features),
                                     device=torch.device("cpu"))
        with torch.no_grad():
            for name, weight in self.unsharded_weights().items():
                ebc.embedding_bags[name].weight.copy_(weight)
        return ebc

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """Adds this rank's pieces of every table and optimizer slot (see ``state_dict.py``: keys
        ``embedding_bags.<table>.weight``, ``optimizer_slots.<table>.<slot>``). A collective."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        weights = self._backend.table_weights() if self._backend else {}
        slots = self._backend.optimizer_slots() if self._backend else {}
        state = checkpoint_state(self.tables, self.shards, weights, slots, self.steps, self._where())
        destination.update({prefix + key: value for key, value in state.items()})

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        keys = [prefix + key for key in state_keys(self.tables)]
        unexpected_keys[:] = [key for key in unexpected_keys if key not in set(keys)]
        missing = [key for key in keys if key not in state_dict]
        if missing:
            if strict:
                missing_keys.extend(missing)
            return
        weights, slots, self.steps = local_state(
            self.tables, self.shards, {key[len(prefix):]: state_dict[key] for key in keys}, self._where())
        if self._backend is not None:
            self._backend.load_state(weights, slots, self.steps)

    def _where(self) -> Group:
        return Group(self.rank, self.world_size, self.group)

    def _gather(self, read, keyed_slots: bool = False) -> dict[str, torch.Tensor]:
        local = read(self._backend) if self._backend else {}
        everyone = [local]
        if self.world_size > 1:
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, local, group=self.group)
        out = {}
        for rank, pieces in enumerate(everyone):
            for key, piece in pieces.items():
                table = key.split("\0")[0] if keyed_slots else key
                shard = next(s for s in self.shards[table] if s.rank == rank)
                if key not in out:
                    spec = self.tables[table]
                    out[key] = torch.zeros((spec.vocab_size,) if piece.dim() == 1 else (spec.vocab_size, spec.dim))
                _place(out[key], shard, piece)
        return out


def _place(full: torch.Tensor, shard: Shard, piece: torch.Tensor) -> None:
    rows = full[shard.row_offset::shard.row_stride]
    if full.dim() == 1:
        rows[: shard.rows] = piece
    else:
        rows[: shard.rows, shard.col_offset:shard.col_offset + shard.cols] = piece


def _cat(arrays: list[np.ndarray], dtype) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype=dtype))


def _all_features(ebc: EmbeddingBagCollection) -> list[str]:
    return [name for config in ebc.embedding_bag_configs() for name in config.feature_names]
