"""``torchrec.experimental.torch_tpu.datasets.input_preprocessing`` on sparsecore's host
preprocessing: a ``KeyedJaggedTensor`` -> per stacked table, jax-tpu-embedding's CSR-wrapped COO
device input (``row_pointers``, ``embedding_ids``, ``sample_ids``, ``gains``) as torch tensors.

Tables stack by ``SparseCoreEmbeddingConfig.stack_table_name`` (a table naming none is its own
stack) and are MOD-sharded over ``global_device_count x num_sc_per_device`` SparseCores; this
process preprocesses its ``batch_size`` samples for its one device (sparsecore's
``StackingPlan.for_local_devices(1)``). Within a stack, features are laid out in name order, as
sparsecore and jax-tpu-embedding lay them out. A sequence table (``EmbeddingConfig``) turns each
id into a sample of its own, over ``batch_size * max_seq_len`` rows.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore.limits import ProposedLimits
from sparsecore.preprocess import preprocess
from sparsecore.specs import SparseCoreTopology
from sparsecore.stacking import StackingPlan, plan_stacking
from sparsecore.validation import integer_ids
from torchrec_tpu.experimental.datasets.fdo.csv_file_fdo_client import CSVFileFDOClient
from torchrec_tpu.experimental.datasets.fdo.fdo_client import (
    FDOClient,
    KeyedSparseCoreInputStats,
    SparseCoreInputStats,
)
from torchrec_tpu.experimental.modules.embedding_configs import (
    SparseCoreEmbeddingConfig,
    StackedSparseCoreEmbeddingConfig,
    sparsecore_specs,
)
from tpu_facts import CHIP_GENERATIONS


@dataclasses.dataclass
class SparseCorePreprocessedInput:
    """One stacked table's device input. For sequence tables, ``lengths`` (per feature, the KJT's
    lengths) and ``actual_num_ids`` (per feature, its id count) let the lookup output be cut back
    into per-sample sequences."""

    row_pointers: torch.Tensor
    embedding_ids: torch.Tensor
    sample_ids: torch.Tensor
    gains: torch.Tensor
    lengths: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    actual_num_ids: dict[str, int] = dataclasses.field(default_factory=dict)
    stats: SparseCoreInputStats | None = None

    def _map(self, fn) -> SparseCorePreprocessedInput:
        return SparseCorePreprocessedInput(
            row_pointers=fn(self.row_pointers), embedding_ids=fn(self.embedding_ids),
            sample_ids=fn(self.sample_ids), gains=fn(self.gains),
            lengths={k: fn(v) for k, v in self.lengths.items()},
            actual_num_ids=self.actual_num_ids, stats=self.stats,
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SparseCorePreprocessedInput:
        """A copy with every tensor on ``device``."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def record_stream(self, stream: torch.Stream) -> None:
        """Mark every tensor as used by ``stream``."""
        for tensor in (self.row_pointers, self.embedding_ids, self.sample_ids, self.gains, *self.lengths.values()):
            tensor.record_stream(stream)

    def pin_memory(self) -> SparseCorePreprocessedInput:
        """A copy with every tensor in pinned host memory."""
        return self._map(lambda t: t.pin_memory())


class KeyedSparseCorePreprocessedInput:
    """:class:`SparseCorePreprocessedInput` by stacked table name, with the step's stats."""

    def __init__(self, table_tensors: dict[str, SparseCorePreprocessedInput],
                 stats: KeyedSparseCoreInputStats | None = None) -> None:
        self.table_tensors = table_tensors
        self.stats = stats

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedSparseCorePreprocessedInput:
        """A copy with every stack's tensors on ``device``."""
        return KeyedSparseCorePreprocessedInput(
            {name: t.to(device, non_blocking=non_blocking) for name, t in self.table_tensors.items()}, self.stats)

    def record_stream(self, stream: torch.Stream) -> None:
        for t in self.table_tensors.values():
            t.record_stream(stream)

    def pin_memory(self) -> KeyedSparseCorePreprocessedInput:
        return KeyedSparseCorePreprocessedInput(
            {name: t.pin_memory() for name, t in self.table_tensors.items()}, self.stats)


def _generation(num_sc_per_device: int) -> str:
    """A chip generation of one device per chip with ``num_sc_per_device`` SparseCores per device."""
    for name, chip in CHIP_GENERATIONS.items():
        if chip.devices_per_chip == 1 and chip.sparsecores_per_device == num_sc_per_device:
            return name
    counts = sorted({c.sparsecores_per_device for c in CHIP_GENERATIONS.values() if c.sparsecores_per_device})
    raise ValueError(f"num_sc_per_device={num_sc_per_device!r}: no TPU has that many SparseCores per device; "
                     f"supported: {counts}")


class SparseCoreInputPreprocessor:
    """Host preprocessing of this process's ``KeyedJaggedTensor`` batches for SparseCore lookups.

    ``tables``: every table, each with its partition limits; ``batch_size``: samples per feature in
    this process's batches; ``global_device_count`` x ``num_sc_per_device``: the SparseCores the
    stacks are MOD-sharded over (a power of two); ``allow_id_dropping``: drop the ids past a
    partition's limits (counted in the stats) instead of raising ``PartitionOverflowError``;
    ``fdo_client``: records every batch's stats; ``fdo_dir``: without a client, a
    :class:`CSVFileFDOClient` there (process id: the torch.distributed rank), seeded with the
    configured limits. Per-id weights of the KJT are dropped (every id counts once, as in TorchRec's
    TPU module), with a warning on the first weighted batch.
    """

    def __init__(
        self,
        tables: list[SparseCoreEmbeddingConfig],
        batch_size: int,
        global_device_count: int = 1,
        num_sc_per_device: int = 2,
        allow_id_dropping: bool = False,
        fdo_client: FDOClient | None = None,
        fdo_dir: str | os.PathLike | None = None,
    ) -> None:
        if not tables:
            raise ValueError("tables is empty: give at least one SparseCoreEmbeddingConfig")
        for table in tables:
            table.samples_per_sample()  # a sequence table without max_seq_len raises here
        if not isinstance(batch_size, int) or batch_size < 1 or batch_size % num_sc_per_device:
            raise ValueError(f"batch_size must be a positive multiple of num_sc_per_device={num_sc_per_device} "
                             f"(each SparseCore takes an equal share of samples), got {batch_size!r}")
        if not isinstance(global_device_count, int) or global_device_count < 1:
            raise ValueError(f"global_device_count must be a positive int, got {global_device_count!r}")
        self._tables = tables
        self._batch_size = batch_size
        self._global_device_count = global_device_count
        self._num_sc_per_device = num_sc_per_device
        self._allow_id_dropping = allow_id_dropping
        self._topology = SparseCoreTopology(_generation(num_sc_per_device), global_device_count)
        self._last_stats: KeyedSparseCoreInputStats | None = None
        self._warned_weights = False
        if fdo_client is None and fdo_dir is not None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            seed = KeyedSparseCoreInputStats({
                t.name: SparseCoreInputStats(0, t.max_ids_per_partition, t.max_unique_ids_per_partition)
                for t in tables})
            fdo_client = CSVFileFDOClient(fdo_dir, process_id=rank, initial_stats=seed)
        self._fdo_client = fdo_client
        self._rebuild_plan()

    def _rebuild_plan(self) -> None:
        """Stack the tables with their current limits: the global plan and this process's share."""
        table_specs, features = sparsecore_specs(self._tables, self._batch_size * self._global_device_count)
        groups: dict[str, list[str]] = {}
        for table in self._tables:
            groups.setdefault(table.stack_table_name or table.name, []).append(table.name)
        for name, members in groups.items():
            kinds = {self._table(t).is_unpooled for t in members}
            if len(kinds) > 1:
                raise ValueError(f"stack {name!r} mixes EmbeddingBagConfig and EmbeddingConfig tables {members}; "
                                 f"they cannot be stacked together")
        plan = plan_stacking(table_specs, features, self._topology, stack_tables=False, groups=groups)
        self._stacked_configs = [StackedSparseCoreEmbeddingConfig.from_stack(s, self._tables) for s in plan.stacks]
        plan = plan.with_limits({c.stack_name: ProposedLimits(c.max_ids_per_partition,
                                                              c.max_unique_ids_per_partition, 0)
                                 for c in self._stacked_configs})
        self._plan: StackingPlan = plan
        self._local_plan = plan.for_local_devices(1)

    def _table(self, name: str) -> SparseCoreEmbeddingConfig:
        return next(t for t in self._tables if t.name == name)

    @property
    def stacked_configs(self) -> list[StackedSparseCoreEmbeddingConfig]:
        """The stacks, in the order their buffers are produced."""
        return self._stacked_configs

    @property
    def plan(self) -> StackingPlan:
        """The sparsecore stacking plan over every device (the device lookups' layout)."""
        return self._plan

    @property
    def fdo_client(self) -> FDOClient | None:
        return self._fdo_client

    @property
    def last_stats(self) -> KeyedSparseCoreInputStats | None:
        """The stats of the most recently preprocessed batch."""
        return self._last_stats

    def publish_fdo(self) -> None:
        """Publish the FDO client's stats, if there is a client."""
        if self._fdo_client is not None:
            self._fdo_client.publish()

    def update_preprocessing_parameters(self, updated_params: KeyedSparseCoreInputStats | None = None,
                                        scale_factor: float = 1.2) -> bool:
        """Raise each table's limits to its observed demand x ``scale_factor`` (never lower them) and
        restack; stats name a table or its stack. ``updated_params`` None: the FDO client's ``load()``.
        Returns whether any limit changed."""
        if updated_params is None:
            if self._fdo_client is None:
                raise ValueError("no FDO client configured on the preprocessor: pass updated_params or fdo_client")
            updated_params = self._fdo_client.load()
        changed = False
        for table in self._tables:
            stack = table.stacked_config.stack_name if table.stacked_config else table.name
            stats = updated_params.table_stats.get(table.name) or updated_params.table_stats.get(stack)
            if stats is None:
                continue
            max_ids = max(table.max_ids_per_partition, math.ceil(stats.observed_max_ids * scale_factor))
            max_unique = max(table.max_unique_ids_per_partition,
                             math.ceil(stats.observed_max_unique_ids * scale_factor))
            if (max_ids, max_unique) != (table.max_ids_per_partition, table.max_unique_ids_per_partition):
                table.max_ids_per_partition, table.max_unique_ids_per_partition = max_ids, max_unique
                changed = True
        if changed:
            self._rebuild_plan()
        return changed

    def _sparsecore_kjt(self, features: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor, dict, dict]:
        """The KJT sparsecore preprocesses (the plan's features, in its order; a sequence feature's
        ids one per sample, padded with empty samples), and per stack of sequence tables the
        features' lengths and id counts."""
        if features.weights_or_none() is not None and not self._warned_weights:
            self._warned_weights = True
            warnings.warn("SparseCoreInputPreprocessor drops the KJT's per-id weights, as TorchRec's TPU module "
                          "does: every id counts with weight 1 (warned once per preprocessor)", UserWarning,
                          stacklevel=3)
        given = features.to_dict()
        values, lengths = [], []
        seq_lengths: dict[str, dict[str, torch.Tensor]] = {}
        seq_counts: dict[str, dict[str, int]] = {}
        for spec in self._local_plan.features:
            table = self._table(spec.table)
            if spec.name not in given:
                raise ValueError(f"the batch has no feature {spec.name!r} (table {table.name!r}); "
                                 f"its keys: {list(features.keys())}")
            jt = given[spec.name]
            ids = torch.from_numpy(integer_ids(jt.values().detach().to("cpu").numpy(),
                                               f"feature {spec.name!r} (table {table.name!r})"))
            if not table.is_unpooled:
                values.append(ids)
                lengths.append(jt.lengths().to("cpu", torch.int64))
                continue
            rows = spec.batch_size  # batch_size * max_seq_len
            if ids.numel() > rows:
                raise ValueError(f"feature {spec.name!r} of sequence table {table.name!r} has {ids.numel()} ids "
                                 f"> batch_size {self._batch_size} x max_seq_len {table.max_seq_len} = {rows}")
            values.append(ids)
            one_each = torch.zeros(rows, dtype=torch.int64)
            one_each[: ids.numel()] = 1
            lengths.append(one_each)
            stack = table.stacked_config.stack_name
            seq_lengths.setdefault(stack, {})[spec.name] = jt.lengths().to("cpu")
            seq_counts.setdefault(stack, {})[spec.name] = ids.numel()
        kjt = KeyedJaggedTensor(
            keys=[f.name for f in self._local_plan.features],
            values=torch.cat(values).to(torch.int64), lengths=torch.cat(lengths))
        return kjt, seq_lengths, seq_counts

    def __call__(self, features: KeyedJaggedTensor) -> KeyedSparseCorePreprocessedInput:
        """Preprocess one batch on the host; features the tables do not name are ignored."""
        kjt, seq_lengths, seq_counts = self._sparsecore_kjt(features)
        batch = preprocess(kjt, self._local_plan, overflow="drop" if self._allow_id_dropping else "error")
        tensors, stats = {}, {}
        for name, csr in batch.stacks.items():
            stats[name] = SparseCoreInputStats(
                dropped_count=int(csr.stats.dropped_ids),
                observed_max_ids=int(np.max(csr.stats.max_ids_per_partition, initial=0)),
                observed_max_unique_ids=int(np.max(csr.stats.max_unique_ids_per_partition, initial=0)))
            tensors[name] = SparseCorePreprocessedInput(
                row_pointers=torch.from_numpy(csr.row_pointers), embedding_ids=torch.from_numpy(csr.embedding_ids),
                sample_ids=torch.from_numpy(csr.sample_ids), gains=torch.from_numpy(csr.gains),
                lengths=seq_lengths.get(name, {}), actual_num_ids=seq_counts.get(name, {}), stats=stats[name])
        keyed = KeyedSparseCoreInputStats(stats)
        self._last_stats = keyed
        if self._fdo_client is not None:
            self._fdo_client.record(keyed)
        return KeyedSparseCorePreprocessedInput(tensors, stats=keyed)
