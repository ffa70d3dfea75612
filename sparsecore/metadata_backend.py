"""Preprocessing driven by jax-tpu-embedding's per-feature stacking metadata.

TorchRec's ``torchrec.experimental.torch_tpu`` (1.9.2) describes each stacked table as a dict:
``name``, ``max_ids_per_partition``, ``max_unique_ids_per_partition``,
``suggested_coo_buffer_size_per_device`` and ``features``, each feature a dict of ``name``,
``row_offset`` (its first row in the stack's global concatenated batch), ``col_offset``,
``col_shift``, ``batch_size`` (this process's samples), ``combiner`` and ``max_col_id`` (the table's
vocabulary) -- jax-tpu-embedding's ``FeatureMetadataInStack``. It hands them to a C++ extension it
does not ship, ``SparseCorePreprocessorBackend``; :class:`SparseCorePreprocessorBackend` here has
its constructor and ``preprocess`` and builds the buffers with ``sparsecore.preprocess`` (the same
bytes as jax-tpu-embedding's C++), mod sharding, ids of feature ``f`` sent to SparseCore
``(id % N + col_shift) % N`` at shard row ``(id + col_offset) // N``.

One difference: the COO buffers always have the static size of every partition at its limit;
``suggested_coo_buffer_size_per_device`` (a smaller size jax-tpu-embedding may use) is accepted and
not applied, so buffers are never too small and the lookups' results are the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from sparsecore.input_checks import check_table_names, checked_ids, positive_int
from sparsecore.optimizers import SGD
from sparsecore.preprocess import preprocess_inputs
from sparsecore.specs import SparseCoreTopology
from sparsecore.stacking import FeaturePlacement, StackedTable, StackingPlan, TablePlacement
from sparsecore.validation import FeatureInput
from tpu_facts import ALIGNMENT, CHIP_GENERATIONS, COMBINERS, round_up

_FEATURE_KEYS = ("name", "row_offset", "col_offset", "col_shift", "batch_size", "combiner")
_TABLE_KEYS = ("name", "max_ids_per_partition", "max_unique_ids_per_partition", "features")


def generation_for(num_sc_per_device: int) -> str:
    """A TPU generation of one device per chip with ``num_sc_per_device`` SparseCores per device."""
    for name, chip in CHIP_GENERATIONS.items():
        if chip.devices_per_chip == 1 and chip.sparsecores_per_device == num_sc_per_device:
            return name
    counts = sorted({c.sparsecores_per_device for c in CHIP_GENERATIONS.values() if c.sparsecores_per_device})
    raise ValueError(f"num_sc_per_device={num_sc_per_device!r}: no TPU has that many SparseCores per device; "
                     f"supported: {counts}")


def _require(mapping: Mapping[str, Any], keys: Sequence[str], what: str) -> None:
    missing = [k for k in keys if k not in mapping]
    if missing:
        raise ValueError(f"{what} lacks {missing}; it has {sorted(mapping)}")


def _stack(meta: Mapping[str, Any], local: int, total: int, n: int) -> StackedTable:
    """One stack's placement, with feature batches and offsets as this process's share."""
    _require(meta, _TABLE_KEYS, f"stack metadata {meta.get('name', '?')!r}")
    name = meta["name"]
    if not meta["features"]:
        raise ValueError(f"stack {name!r} has no features")
    features, combiners, table_rows_by_offset = [], set(), {}
    for f in sorted(meta["features"], key=lambda f: f["row_offset"]):
        _require(f, _FEATURE_KEYS, f"feature metadata of stack {name!r}")
        if f["combiner"] not in COMBINERS:
            raise ValueError(f"feature {f['name']!r}: combiner {f['combiner']!r} is not one of {list(COMBINERS)}")
        combiners.add(f["combiner"])
        table_rows = f.get("max_col_id", 2**31 - 1)
        table_rows_by_offset[f["col_offset"]] = max(table_rows_by_offset.get(f["col_offset"], 0), table_rows)
        batch = positive_int(f["batch_size"], f"feature {f['name']!r} batch_size")
        if batch % (n // total * local):
            raise ValueError(f"feature {f['name']!r}: batch_size {batch} does not split over this process's "
                             f"{n // total * local} SparseCores")
        features.append(FeaturePlacement(f["name"], f"{name}@{f['col_offset']}", batch,
                                          f["row_offset"] * local // total, f["col_offset"], f["col_shift"]))
    if len(combiners) > 1:
        raise ValueError(f"stack {name!r} mixes combiners {sorted(combiners)}; a stack has one combiner")
    tables, end = [], 0
    for offset in sorted(table_rows_by_offset):
        if offset % n or offset < end:
            raise ValueError(f"stack {name!r}: col_offset {offset} is not a multiple of {n} SparseCores past the "
                             f"previous table's rows (ending at {end})")
        padded = round_up(table_rows_by_offset[offset], ALIGNMENT * n)
        if offset > end:  # rows before this table (unused by these features)
            tables.append(TablePlacement(f"{name}@gap{end}", offset - end, 0, offset - end, end // n, 0))
        tables.append(TablePlacement(f"{name}@{offset}", table_rows_by_offset[offset], 0, padded, offset // n, 0))
        end = offset + padded
    return StackedTable(name, 0, SGD(), combiners.pop(), n, tuple(tables), tuple(features),
                        positive_int(meta["max_ids_per_partition"], f"stack {name!r} max_ids_per_partition"),
                        positive_int(meta["max_unique_ids_per_partition"],
                                      f"stack {name!r} max_unique_ids_per_partition"))


def _feature_input(feature: FeaturePlacement, table_rows: int, indices: torch.Tensor, offsets: torch.Tensor,
                   ) -> FeatureInput:
    """A feature's ids and lengths from its (int32) ragged indices and offsets, checked."""
    for t, what in ((indices, "indices"), (offsets, "offsets")):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
            raise ValueError(f"feature {feature.feature!r}: {what} must be a 1-D int32 tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} of shape {tuple(getattr(t, 'shape', ()))}")
    where = f"feature {feature.feature!r}"
    offs = offsets.cpu().numpy().astype(np.int64)
    if offs.size != feature.samples + 1:
        raise ValueError(f"{where}: offsets for {offs.size - 1} samples, expected {feature.samples} (batch_size)")
    if offs[0] != 0:
        raise ValueError(f"{where}: offsets must start at 0, got {offs[0]}")
    lengths = np.diff(offs)
    if (lengths < 0).any():
        sample = int(np.flatnonzero(lengths < 0)[0])
        raise ValueError(f"{where}: sample {sample} has length {int(lengths[sample])}; a length counts the sample's "
                         "ids (>= 0)")
    if offs[-1] > indices.numel():
        raise ValueError(f"{where}: lengths sum to {offs[-1]} but there are {indices.numel()} indices")
    ids = checked_ids(indices.cpu().numpy()[: offs[-1]], table_rows, where)
    return FeatureInput(ids, lengths, np.ones(ids.size, dtype=np.float32))


class SparseCorePreprocessorBackend:
    """TorchRec TPU's host preprocessing backend: CSR-wrapped COO buffers of this process's
    ``local_device_count`` devices of ``global_device_count`` x ``num_sc_per_device`` SparseCores,
    per stacked table described by ``tables_metadata`` (module docstring). ``allow_id_dropping``:
    ids past a partition's limits are dropped and counted; else they raise
    ``sparsecore.limits.PartitionOverflowError``."""

    def __init__(self, tables_metadata: Sequence[Mapping[str, Any]], batch_size: int, local_device_count: int,
                 global_device_count: int, num_sc_per_device: int, allow_id_dropping: bool = False) -> None:
        self.batch_size = positive_int(batch_size, "batch_size")
        local = positive_int(local_device_count, "local_device_count")
        total = positive_int(global_device_count, "global_device_count")
        if local > total:
            raise ValueError(f"local_device_count {local} exceeds global_device_count {total}")
        generation = generation_for(num_sc_per_device)
        n = SparseCoreTopology(generation, total).num_sparsecores  # checks N is a power of two
        if not tables_metadata:
            raise ValueError("tables_metadata is empty: give at least one stacked table")
        for meta in tables_metadata:
            _require(meta, _TABLE_KEYS, f"stack metadata {meta.get('name', '?')!r}")
        check_table_names(((meta["name"], [f.get("name") for f in meta["features"]]) for meta in tables_metadata),
                          "stack")
        stacks = tuple(_stack(meta, local, total, n) for meta in tables_metadata)
        self._table_rows = {f["name"]: positive_int(f.get("max_col_id", 2**31 - 1), f"feature {f['name']!r} max_col_id")
                            for meta in tables_metadata for f in meta["features"]}
        self._plan = StackingPlan(SparseCoreTopology(generation, local), {}, (), stacks)
        self._overflow = "drop" if allow_id_dropping else "error"

    def preprocess(self, input_indices: Mapping[str, Sequence[torch.Tensor]],
                   input_offsets: Mapping[str, Sequence[torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        """Per stack: ``row_pointers``, ``embedding_ids``, ``sample_ids``, ``gains`` and the scalar
        stats ``dropped_count``, ``observed_max_ids``, ``observed_max_unique_ids`` (int32 tensors).
        ``input_indices[stack]`` / ``input_offsets[stack]``: one int32 tensor per feature of the
        stack, in the stack's feature order (ragged: the offsets delimit each sample's ids)."""
        inputs = {}
        for stack in self._plan.stacks:
            indices, offsets = input_indices.get(stack.name), input_offsets.get(stack.name)
            if indices is None or offsets is None:
                raise ValueError(f"input_indices and input_offsets need stack {stack.name!r}; got "
                                 f"{sorted(input_indices)} and {sorted(input_offsets)}")
            if len(indices) != len(stack.features) or len(offsets) != len(stack.features):
                raise ValueError(f"stack {stack.name!r} has {len(stack.features)} features; got {len(indices)} "
                                 f"indices and {len(offsets)} offsets tensors")
            for feature, ids, offs in zip(stack.features, indices, offsets):
                inputs[feature.feature] = _feature_input(feature, self._table_rows[feature.feature], ids, offs)
        batch = preprocess_inputs(inputs, self._plan, overflow=self._overflow)
        out = {}
        for name, csr in batch.stacks.items():
            out[name] = {
                "row_pointers": torch.from_numpy(csr.row_pointers),
                "embedding_ids": torch.from_numpy(csr.embedding_ids),
                "sample_ids": torch.from_numpy(csr.sample_ids),
                "gains": torch.from_numpy(csr.gains),
                "dropped_count": torch.tensor(int(csr.stats.dropped_ids), dtype=torch.int32),
                "observed_max_ids": torch.tensor(int(np.max(csr.stats.max_ids_per_partition, initial=0)),
                                                 dtype=torch.int32),
                "observed_max_unique_ids": torch.tensor(
                    int(np.max(csr.stats.max_unique_ids_per_partition, initial=0)), dtype=torch.int32),
            }
        return out
