"""``ShardedSparseCoreEBC``: a TorchRec-style sharded EmbeddingBagCollection on the sparsecore engine.

A KeyedJaggedTensor of this rank's batch goes in, a KeyedTensor of its pooled embeddings comes
out, like TorchRec's ``ShardedEmbeddingBagCollection``. In between:

1. input dist: the combiner is folded into per-id gains (as the SparseCore host does), ids are
   routed to the ranks holding their shard (row-wise: id mod W; a managed-collision table's raw
   ids as TorchRec routes them, then remapped there, see ``zch_tables``) and exchanged with
   uneven all_to_alls; every shard sees the global batch (ranks' samples in rank order);
2. each rank's shards run as one local sparsecore backend (lookup now, fused update in backward);
3. output dist: one all_to_all returns each rank's rows of every shard's output, which are placed
   (table/column-wise), summed (row-wise) or taken from the local replica (data-parallel).

Backward sends each shard the gradient of its output for all samples and applies the fused
optimizer there; no gradient of the tables ever materialises.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from sparsecore.optimizers import OptimizerSpec
from sparsecore.preprocess import combined_gains
from sparsecore.specs import FeatureSpec, TableSpec
from sparsecore.torchrec_convert import configs_from_specs, specs_from_configs
from sparsecore.validation import FeatureInput, feature_inputs
from torchrec_tpu.sharding.batching import fixed_size_chunks
from torchrec_tpu.sharding.collectives import all_to_all
from torchrec_tpu.sharding.column_blocks import ColumnSelection
from torchrec_tpu.sharding.fdo import FdoTuner
from torchrec_tpu.sharding.sharded_tables import ShardedTables, concat, features_at
from torchrec_tpu.sharding.shards import TableSharding
from torchrec_tpu.sharding.zch import ZchSpec
from torchrec_tpu.sharding.zch_tables import ZchBatch
from tpu_facts import global_batch_of, padded_local_batch_of


@dataclass
class LocalBatch:
    """What input dist delivers to this rank: global-batch inputs of its shards, by feature, and
    the local backend's prepared form of them (``Backend.prepare``, done where the dist ran);
    ``zch``: what the batch's managed-collision remap left for its lookup; ``fdo``: see there."""

    inputs: dict[str, FeatureInput]
    prepared: Any = None
    zch: ZchBatch | None = None
    fdo: np.ndarray | None = None  # the batch's partition maxima over every rank (FdoTuner.over_ranks)


class PrefetchedKJT(KeyedJaggedTensor):
    """``kjt`` with the input dist that ``owner`` already ran for it (:meth:`ShardedSparseCoreEBC.prefetch`):
    ``owner``'s forward starts from ``local``; to any other module it is a plain KJT. Moving it
    to the device it is on keeps it (``Batch.to`` in the loop); to another device gives a plain
    KJT, whose input dist then runs in the forward."""

    def __init__(self, kjt: KeyedJaggedTensor, owner: "ShardedSparseCoreEBC", local: LocalBatch) -> None:
        super().__init__(keys=kjt.keys(), values=kjt.values(), weights=kjt.weights_or_none(),
                         lengths=kjt.lengths(), offsets=kjt.offsets(), stride=kjt.stride())
        self.owner, self.local = owner, local

    def to(self, device: torch.device, non_blocking: bool = False,
           dtype: torch.dtype | None = None) -> KeyedJaggedTensor:
        if dtype is None and self.values().device == torch.device(device):
            return self
        return super().to(device, non_blocking=non_blocking, dtype=dtype)


@dataclass
class SentLengths:
    """A batch's input dist after its lengths' all_to_all (:meth:`ShardedSparseCoreEBC.send_lengths`).

    ``flags``: every rank's flags, ``[world, flags given]``; ``failed``: per rank, whether its
    batch failed validation (``error``: this rank's error); ``finish``: the rest of the input dist
    (collectives), None without a batch. Every rank calls ``finish`` or none does, and only when
    every rank sent a batch and none failed."""

    flags: np.ndarray
    failed: np.ndarray
    error: Exception | None
    finish: Callable[[], PrefetchedKJT] | None


class ShardedSparseCoreEBC(ShardedTables):
    """Pooled lookups of ``features`` (their ``batch_size``: this rank's batch, ``local_batch``;
    checked padded to ``padded_local_batch``, looked up by the backend over the ranks' ``global_batch``)
    over ``tables``, sharded over ``group`` (default: the world; no process group: one rank) as
    ``sharding`` says; the options (weights, local engine, ``average_over_ranks``) are
    :class:`ShardedTables`'.

    SparseCores split the global batch evenly; a batch that does not divide among them is padded
    with empty samples to ``padded_local_batch`` (:func:`tpu_facts.padded_local_batch_of`), the
    size every lookup runs at, as TorchRec, which has no such rule, takes any batch size."""

    table_modules = "embedding_bags"

    def _configure(self) -> None:
        self.fdo: FdoTuner | None = None  # records the training steps' partition maxima (record_fdo)
        self.padded_local_batch = padded_local_batch_of(self.local_batch, self.engine.topology.num_sparsecores,
                                                        self.world_size)
        # what a KJT is checked against when it reaches the input dist: padded to the SparseCores' split
        self._padded_features = features_at(self.features, self.padded_local_batch)
        dims = [self.tables[f.table].dim for f in self.features]
        self._offsets = dict(zip([f.name for f in self.features], np.cumsum([0] + dims).tolist()))
        # output columns of every rank's served (feature, shard) pairs, in message order
        self._columns = [torch.from_numpy(np.concatenate(
            [np.arange(self._offsets[f.name] + s.col_offset, self._offsets[f.name] + s.col_offset + s.cols)
             for f, s in pairs] or [np.zeros(0, dtype=np.int64)])) for pairs in self._served]
        self._selections = [ColumnSelection(columns, sum(dims)) for columns in self._columns]
        self._placement = _OutputPlacement(self._served, self._columns, self.rank, sum(dims))

    @property
    def global_batch(self) -> int:
        """Every rank's padded samples: the batch the local backend looks up."""
        return global_batch_of(self.padded_local_batch, self.world_size)

    def activation_columns(self, feature_order: Sequence[str]) -> np.ndarray | None:
        """The columns of this rank's local activations that hold the output of ``feature_order``'s
        features, each feature's ``dim`` columns in that order; None unless this rank alone serves
        every output column exactly once (one rank, no row-wise partial sums to add)."""
        unknown = sorted(set(feature_order) - set(self._offsets))
        if unknown:
            raise ValueError(f"features {unknown} are not among this EBC's features {sorted(self._offsets)}")
        placement = self._placement
        if self.world_size != 1 or not placement.permutation:
            return None
        dims = {f.name: self.tables[f.table].dim for f in self.features}
        wanted = np.concatenate([np.arange(self._offsets[name], self._offsets[name] + dims[name])
                                 for name in feature_order])
        order = np.arange(placement.width) if placement.identity else placement.order.columns.numpy()
        return order[wanted]

    def exchange_columns(self, feature_order: Sequence[str]) -> tuple[np.ndarray, np.ndarray, int] | None:
        """How one all-to-all of every rank's padded activations ([batch, ``width``] from each
        source rank, sources side by side) becomes this rank's pooled output in ``feature_order``:
        ``(targets, sources, width)``; received column j adds into output column ``targets[j]``
        (the output width: dropped) and takes the gradient of output column ``sources[j]`` (the
        output width: none). None unless the ranks are uniform (``uniform_ranks``)."""
        if not self.uniform_ranks:
            return None
        dims = {f.name: self.tables[f.table].dim for f in self.features}
        order = np.concatenate([np.arange(self._offsets[name], self._offsets[name] + dims[name])
                                for name in feature_order])
        total = order.size
        position = np.full(sum(dims.values()), total)
        position[order] = np.arange(total)
        width = self.padded_width
        targets, sources = np.full(self.world_size * width, total), np.full(self.world_size * width, total)
        for source, (pairs, columns) in enumerate(zip(self._served, self._columns)):
            at = position[columns.numpy()]
            replica = np.concatenate([np.full(s.cols, s.kind == "data_parallel" and source != self.rank)
                                      for _, s in pairs] or [np.zeros(0, dtype=bool)])
            targets[source * width:source * width + at.size] = np.where(replica, total, at)
            sources[source * width:source * width + at.size] = at
        return targets, sources, width

    @property
    def padded_width(self) -> int:
        """Columns of each rank's local activations, its pads' included (the same on every rank
        when ``uniform_ranks``)."""
        plan = self._backend.plan if self._backend is not None else None
        return 0 if plan is None else sum(plan.tables[f.table].dim for f in plan.features)

    def _local_features(self, rank: int) -> list[FeatureSpec]:
        """Each served feature over the global batch, weighted (the gains carry the combiner)."""
        return [FeatureSpec(f.name, f.table, self.global_batch, weighted=True)
                for f, _ in self._served[rank]]

    @staticmethod
    def specs_of(ebc: EmbeddingBagCollection, batch_size: int, optimizer: OptimizerSpec,
                 partition_limits: Mapping[str, tuple[int, int]] | None = None,
                 ) -> tuple[list[TableSpec], list[FeatureSpec]]:
        """The sparsecore (tables, features) of TorchRec ``ebc`` at ``batch_size`` samples per rank
        (the local batch);
        ``partition_limits``: table -> (max_ids_per_partition, max_unique_ids_per_partition), e.g.
        from ``SparseCoreEmbeddingConfig`` or FDO stats (default: 256 each)."""
        return specs_from_configs(ebc.embedding_bag_configs(), batch_size, optimizer=optimizer,
                                  weighted_features=ebc.is_weighted() and _all_features(ebc) or (),
                                  partition_limits=partition_limits)

    @classmethod
    def from_torchrec(cls, ebc: EmbeddingBagCollection | ManagedCollisionEmbeddingBagCollection, batch_size: int,
                      sharding: Mapping[str, TableSharding], optimizer: OptimizerSpec,
                      specs: tuple[Sequence[TableSpec], Sequence[FeatureSpec]] | None = None,
                      partition_limits: Mapping[str, tuple[int, int]] | None = None,
                      **kwargs: Any) -> "ShardedSparseCoreEBC":
        """The same tables as TorchRec ``ebc`` (and its weights unless they are on the meta device);
        ``specs``: :meth:`specs_of` ``ebc`` (with ``batch_size``, ``optimizer`` and
        ``partition_limits``) when the caller has them already. A managed-collision ``ebc``
        (MC-EBC of ``MCHManagedCollisionModule``s) keeps its remaps: their policies and state
        (:meth:`ZchSpec.of_torchrec`, :func:`~torchrec_tpu.sharding.zch.torchrec_state`)."""
        if isinstance(ebc, ManagedCollisionEmbeddingBagCollection):
            modules = dict(ebc._managed_collision_collection._managed_collision_modules.items())
            sharded = cls.from_torchrec(ebc._embedding_module, batch_size, sharding, optimizer, specs,
                                        partition_limits, **kwargs)
            sharded.manage_collisions({name: ZchSpec.of_torchrec(module) for name, module in modules.items()})
            sharded.zch.load_torchrec(modules)
            return sharded
        if specs is not None and partition_limits is not None:
            raise ValueError("give partition_limits to specs_of when passing specs, not to from_torchrec")
        tables, features = specs if specs is not None else ShardedSparseCoreEBC.specs_of(
            ebc, batch_size, optimizer, partition_limits)
        return cls._from_torchrec_modules(list(tables), list(features), ebc.embedding_bags, sharding, **kwargs)

    def record_fdo(self, primary: bool) -> FdoTuner:
        """Record every training step's partition maxima from now on (:mod:`~torchrec_tpu.sharding.fdo`;
        ``primary``: this rank logs the limits it raises); the local backend must take new limits."""
        self.fdo = FdoTuner(self, primary)
        return self.fdo

    def forward(self, kjt: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of ``kjt``'s samples. Other batch sizes than ``padded_local_batch`` are padded
        (smaller) or, without grad, looked up in chunks (larger); every rank must make the same
        calls, as the dists are collectives."""
        ahead = kjt.local if isinstance(kjt, PrefetchedKJT) and kjt.owner is self else None
        size = self.padded_local_batch
        if ahead is not None or kjt.stride() == size:
            pooled = self.compute_and_output_dist(ahead or self.input_dist(kjt))
            return pooled if kjt.stride() == size else _first_samples(pooled, kjt.stride())
        if kjt.stride() > size and torch.is_grad_enabled():
            raise ValueError(f"a training batch of {kjt.stride()} samples exceeds the EBC's padded_local_batch "
                             f"{size} (per rank); evaluate larger batches under torch.no_grad()")
        parts = [self.compute_and_output_dist(self.input_dist(chunk)).values()[:real]
                 for chunk, real in fixed_size_chunks(kjt, size)]
        return KeyedTensor(keys=[f.name for f in self.features],
                           length_per_key=[self.tables[f.table].dim for f in self.features], values=torch.cat(parts))

    def prefetch(self, kjt: KeyedJaggedTensor, group: dist.ProcessGroup | None = None) -> "PrefetchedKJT":
        """Run the input dist of a coming batch now (e.g. on a pipeline thread, over its own
        ``group`` so its collectives never interleave with the step's); ``forward`` of the
        returned KJT starts from the result. Every rank must prefetch the same batches in the
        same order (the dists are collectives); they may be consumed in any order."""
        return PrefetchedKJT(kjt, self, self.input_dist(self._prefetchable(kjt), group, training=True))

    def send_lengths(self, kjt: KeyedJaggedTensor | None, group: dist.ProcessGroup | None,
                     flags: Sequence[int] = ()) -> SentLengths:
        """The first half of a prefetch with several ranks (a collective): validate ``kjt`` and
        exchange its lengths over ``group``, every rank's ``flags`` riding along, so the ranks can
        agree on a batch without a collective of its own. Without a batch (``kjt`` None), or when
        it fails validation, this rank sends zero lengths."""
        error, routed = None, None
        if kjt is not None:
            try:
                routed = self._routed(self._prefetchable(kjt))
            except Exception as failure:  # noqa: BLE001  reported to every rank through the flags
                error = failure
        every, rest = self._send_routed(routed or self._nothing_routed(), [*flags, error is not None], group, True)
        return SentLengths(every[:, :-1], every[:, -1].astype(bool), error,
                           None if kjt is None else lambda: PrefetchedKJT(kjt, self, rest()))

    def _prefetchable(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        if kjt.stride() > self.padded_local_batch:
            raise ValueError(f"cannot prefetch a batch of {kjt.stride()} samples: over the EBC's padded_local_batch "
                             f"{self.padded_local_batch} (per rank)")
        return next(fixed_size_chunks(kjt, self.padded_local_batch))[0]

    def compile(self, kjt: KeyedJaggedTensor) -> None:
        """Compile the local lookup and update programs for batches like ``kjt`` ahead of the
        steps (runs its input dist: a collective, call it on every rank)."""
        batch = self.input_dist(kjt, training=False)
        if self._backend is not None:
            self._backend.compile(batch.prepared)

    def input_dist(self, kjt: KeyedJaggedTensor, group: dist.ProcessGroup | None = None,
                   training: bool | None = None) -> LocalBatch:
        """Validate ``kjt`` (errors name the feature), fold combiners into gains, exchange ids
        (over ``group``, default the EBC's), remap managed ids to slots (``training``: counting
        them toward the eviction policy; default: the module's mode) and prepare the local
        backend's input."""
        group = group if group is not None else self.group
        training = self.training if training is None else training
        lengths, ids, gains = self._routed(kjt)
        if self.world_size == 1:
            received = {f.name: FeatureInput(*piece) for (f, _), *piece in zip(self._served[0], ids, lengths, gains)}
            received, zch = self._remapped(received, training)
            return LocalBatch(received, self._backend.prepare(received) if self._backend else None, zch)
        _, rest = self._send_routed((lengths, ids, gains), (), group, training)
        return rest()

    def _remapped(self, received: dict[str, FeatureInput], training: bool,
                  ) -> tuple[dict[str, FeatureInput], ZchBatch | None]:
        """``received`` with the managed-collision tables' raw ids as rows (unchanged without any)."""
        return (received, None) if self.zch is None else self.zch.remap(received, training)

    def _routed(self, kjt: KeyedJaggedTensor) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
        """Validated (lengths, ids, gains) of every rank's served (feature, shard) pairs, in
        message order: combiners folded into gains, a row-wise shard's ids kept where it owns them
        (a managed-collision table's raw, where :meth:`ManagedCollisions.owners` routes them)."""
        raw = self.zch.raw_features if self.zch is not None else frozenset()
        inputs = feature_inputs(kjt, self._padded_features, self.tables, self.engine.id_policy, raw)
        owners = {f.name: self.zch.owners(f.table, inputs[f.name].ids) for f in self.features if f.name in raw}
        lengths, ids, gains = [], [], []
        for served in self._served:
            for f, shard in served:
                x = inputs[f.name]
                combiner = self.tables[f.table].combiner
                by_sample = combiner != "sum" or shard.row_stride > 1
                sample = np.repeat(np.arange(x.lengths.size), x.lengths) if by_sample else None
                gain = combined_gains(x.weights, x.lengths, sample, combiner)
                if shard.row_stride > 1:
                    keep = shard.owns(x.ids) if f.name not in raw else owners[f.name] == shard.rank
                    lengths.append(np.bincount(sample[keep], minlength=x.lengths.size))
                    ids.append(shard.local_rows(x.ids[keep]) if f.name not in raw else x.ids[keep])
                    gains.append(gain[keep])
                else:
                    lengths.append(x.lengths)
                    ids.append(x.ids)
                    gains.append(gain)
        return lengths, ids, gains

    def _nothing_routed(self) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
        """What a rank without a batch sends: zero lengths, no ids."""
        pairs = sum(len(served) for served in self._served)
        return ([np.zeros(self.padded_local_batch, np.int64)] * pairs, [np.zeros(0, np.int64)] * pairs,
                [np.zeros(0, np.float32)] * pairs)

    def _send_routed(self, routed: tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]],
                    flags: Sequence[int], group: dist.ProcessGroup | None, training: bool,
                    ) -> tuple[np.ndarray, Callable[[], LocalBatch]]:
        """Exchange ``routed``'s lengths, ``flags`` riding along with whether this rank's gains are
        all 1: (every rank's ``flags``, the rest of the input dist, remapping as ``training``)."""
        lengths, ids, gains = routed
        unit = all(bool((g == 1).all()) for g in gains)
        per_source, every = self._exchange_lengths(lengths, [*flags, not unit], group)
        return every[:, :-1], partial(self._finish_input_dist, per_source, ids, gains, not every[:, -1].any(), group,
                                      training)

    def _finish_input_dist(self, per_source: np.ndarray, ids: list[np.ndarray], gains: list[np.ndarray],
                           all_unit: bool, group: dist.ProcessGroup | None, training: bool) -> LocalBatch:
        """After the lengths' all_to_all: the ids' (and, unless every rank's gains are all 1, the
        gains'), the remap of the managed ids received, and the local backend's input."""
        id_counts = self._per_destination([len(a) for a in ids])
        recv_counts = per_source.sum(axis=1).tolist()
        recv_ids = all_to_all(concat(ids, np.int64), id_counts, recv_counts, group).numpy()
        recv_gains = (np.ones(recv_ids.size, np.float32) if all_unit
                      else all_to_all(concat(gains, np.float32), id_counts, recv_counts, group).numpy())
        received, zch = self._remapped(self._assemble_inputs(per_source, recv_ids, recv_gains), training)
        if not self.uniform_ranks:
            return LocalBatch(received, self._backend.prepare(received) if self._backend else None, zch)
        samples = self.global_batch
        pads = {f.name: FeatureInput(np.zeros(0, np.int64), np.zeros(samples, np.int64), np.zeros(0, np.float32))
                for f in self.padding.features}
        return LocalBatch(received, self._backend.prepare({**received, **pads}, agree=partial(_max_over, group=group)),
                          zch)

    def _exchange_lengths(self, lengths: list[np.ndarray], flags: Sequence[int],
                          group: dist.ProcessGroup | None) -> tuple[np.ndarray, np.ndarray]:
        """The lengths every rank sends this one, ``[world, served features x padded batch]``, and
        every rank's ``flags``, ``[world, len(flags)]``: each rank's flags ride after its lengths
        to each rank."""
        b = self.padded_local_batch
        mine = np.asarray(flags, np.int64)
        send, start = [], 0
        for served in self._served:
            send += [*lengths[start:start + len(served)], mine]
            start += len(served)
        counts = [len(served) * b + mine.size for served in self._served]
        recv = all_to_all(concat(send, np.int64), counts,
                          [len(self._served[self.rank]) * b + mine.size] * self.world_size, group).numpy()
        per_source = recv.reshape(self.world_size, -1)
        return per_source[:, :-mine.size], per_source[:, -mine.size:]

    def _assemble_inputs(self, per_source: np.ndarray, ids: np.ndarray, gains: np.ndarray) -> dict[str, FeatureInput]:
        """Per served feature: the global batch, source ranks' samples in rank order."""
        served = self._served[self.rank]
        b = self.padded_local_batch
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
        """Look up the local shards and return this rank's pooled embeddings (a training step's
        partition maxima recorded by :attr:`fdo`, when set)."""
        if self.fdo is not None and self.training and torch.is_grad_enabled():
            self.fdo.stepped(batch)
        self.settle_collisions(batch)
        values = self._looked_up(batch)
        return KeyedTensor(keys=[f.name for f in self.features],
                           length_per_key=[self.tables[f.table].dim for f in self.features], values=values)

    def _lookup(self, batch: LocalBatch) -> tuple[torch.Tensor, Any]:
        """The local shards' outputs for the global batch, [world * batch, served columns]."""
        if self._backend is None:
            return torch.zeros(self.global_batch, 0), None
        activations, context = self._backend.lookup(batch.prepared if batch.prepared is not None else batch.inputs)
        if self.padding:
            activations = activations[:, :len(self._columns[self.rank])].contiguous()  # the pads' columns last
        return activations, context

    def _output_dist(self, activations: torch.Tensor) -> torch.Tensor:
        """Each rank's rows of every shard's output, placed into this rank's [batch, dims] output."""
        b, widths = self.padded_local_batch, [len(c) for c in self._columns]
        if self.world_size == 1:
            return self._placement(activations)
        recv = all_to_all(activations.reshape(-1), [b * widths[self.rank]] * self.world_size,
                          [b * w for w in widths], self.group)
        parts = recv.split([b * w for w in widths])
        return self._placement(torch.cat([part.view(b, w) for part, w in zip(parts, widths)], dim=1))

    def _update(self, context: Any, grad: torch.Tensor) -> None:
        """Send every shard the gradient of its output for this rank's samples; apply the update."""
        b, widths = self.padded_local_batch, [len(c) for c in self._columns]
        if self.world_size == 1:
            recv = grad if self._placement.identity else self._selections[0](grad)
        else:
            send = torch.cat([select(grad).reshape(-1) for select in self._selections])
            recv = all_to_all(send, [b * w for w in widths], [b * widths[self.rank]] * self.world_size, self.group)
        if self._backend is not None:
            grad = recv.view(self.world_size * b, widths[self.rank])
            if self.padding:
                grad = torch.nn.functional.pad(grad, (0, self.padded_width - widths[self.rank]))
            self._backend.update(context, grad)

    def settle_collisions(self, batch: LocalBatch) -> None:
        """Before ``batch``'s lookup: reset the rows its managed-collision remap evicted."""
        if self.zch is not None:
            self.zch.settle(batch.zch)

    def to_torchrec(self) -> EmbeddingBagCollection:
        """A plain CPU TorchRec EBC holding the current tables, for serving (a collective)."""
        ebc = EmbeddingBagCollection(tables=configs_from_specs(list(self.tables.values()), self.features),
                                     device=torch.device("cpu"))
        self._copy_unsharded_into(ebc.embedding_bags)
        return ebc


class _OutputPlacement:
    """Places the received shard outputs ([batch, columns of every source rank in rank order])
    into the output: a copy (or nothing) when every output column arrives exactly once, else
    summed (row-wise shards) with other ranks' data-parallel replicas left out."""

    def __init__(self, served, columns: list[torch.Tensor], rank: int, width: int):
        targets = []
        for source, (pairs, cols) in enumerate(zip(served, columns)):
            dropped = np.concatenate([np.full(s.cols, s.kind == "data_parallel" and source != rank) for _, s in pairs]
                                     or [np.zeros(0, dtype=bool)])
            targets.append(np.where(dropped, width, cols.numpy()))
        self.targets = torch.from_numpy(np.concatenate(targets))
        self.width = width
        kept = self.targets[self.targets < width]
        self.permutation = kept.numel() == width and bool((torch.bincount(kept, minlength=width) == 1).all())
        order = torch.argsort(self.targets)[:width] if self.permutation else None
        self.identity = (self.permutation and self.targets.numel() == width
                         and bool((order == torch.arange(width)).all()))
        self.order = ColumnSelection(order, self.targets.numel()) if self.permutation else None

    def __call__(self, received: torch.Tensor) -> torch.Tensor:
        if self.identity:
            return received
        if self.permutation:
            return self.order(received)
        out = received.new_zeros(received.shape[0], self.width + 1).index_add_(1, self.targets, received)
        return out[:, : self.width].contiguous()


def _max_over(sizes: list[int], group: dist.ProcessGroup | None) -> list[int]:
    """Each of ``sizes``' maximum over the ranks of ``group`` (a collective)."""
    values = torch.tensor(sizes, dtype=torch.int64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return values.tolist()


def _all_features(ebc: EmbeddingBagCollection) -> list[str]:
    return [name for config in ebc.embedding_bag_configs() for name in config.feature_names]


def _first_samples(pooled: KeyedTensor, samples: int) -> KeyedTensor:
    return KeyedTensor(keys=pooled.keys(), length_per_key=pooled.length_per_key(), values=pooled.values()[:samples])
