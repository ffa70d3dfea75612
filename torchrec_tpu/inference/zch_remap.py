"""The frozen managed-collision remap of a ``train --zch`` checkpoint, for inference: raw ids go
to the rows training gave them, an id it never kept to its table's last row (TorchRec's default
slot for a miss; a row-wise table trained on several ranks: the last row of the shard the id
routes to, as there); nothing is counted or evicted."""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from typing import Any

import torch

from torchrec_tpu.sharding.zch import MOD_ROUTING, RoutedLookup, TableRemap, ZchSpec
from torchrec_tpu.sharding.zch_collection import ZchCollection
from torchrec_tpu.sharding.zch_tables import STATE_KEY, load_state_bytes
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.model import EBC_PATH, ModelSpec, table_name

SAVED_KEY = f"{EBC_PATH}.{STATE_KEY}"  # in the checkpoint's model state


def saved_remap(meta: dict[str, Any], saved_keys: set[str], spec: ModelSpec,
                load: Callable[[str], bytes]) -> ZchCollection | None:
    """The remap a checkpoint holds (None: its tables take ids modulo their rows); ``saved_keys``:
    the keys of its DCP state, ``load(key)``: reads one plain value of the model's state."""
    per_rank = sorted(key[len("model."):] for key in saved_keys if re.fullmatch(
        rf"model\.{re.escape(SAVED_KEY)}\.rank\d+_of_\d+", key))
    if f"model.{SAVED_KEY}" not in saved_keys and not per_rank:
        return None
    managed = TrainConfig.from_options(**meta["config"]).engine.zch_tables(spec.feature_names)
    rows = dict(zip(spec.feature_names, spec.table_sizes))
    specs = {table_name(f): (rows[f], ZchSpec(policy, interval, input_hash_size=MOD_ROUTING))
             for f, (policy, interval) in managed.items()}
    remap = ZchCollection(specs, {table_name(f): [f] for f in managed})
    if not per_rank:
        load_state_bytes(remap, load(SAVED_KEY))
        return remap
    ranks = sorted(per_rank, key=lambda key: int(re.search(r"rank(\d+)_of", key).group(1)))
    states = [torch.load(io.BytesIO(load(key)), weights_only=True) for key in ranks]
    for table, (table_rows, table_spec) in specs.items():
        shards = [_table_state(state, table) for state in states if f"{table}._mch_sorted_raw_ids" in state]
        whole = [shard for shard in shards if shard["_mch_sorted_raw_ids"].numel() == table_rows]
        if whole:  # on one rank, or alike on each (table-, column-wise, replicas)
            remap.remaps[table].load_state_dict(whole[0])
            continue
        parts = []
        for shard in shards:
            part = TableRemap(shard["_mch_sorted_raw_ids"].numel(), table_spec)
            part.load_state_dict(shard)
            parts.append(part)
        remap.remaps[table] = RoutedLookup(tuple(parts), table_spec.input_hash_size)  # type: ignore[assignment]
    return remap


def _table_state(state: dict[str, torch.Tensor], table: str) -> dict[str, torch.Tensor]:
    return {key[len(table) + 1:]: value for key, value in state.items() if key.startswith(f"{table}.")}


def read_sizes(spec: ModelSpec, remap: ZchCollection | None) -> tuple[int, ...]:
    """What each feature's ids are taken modulo when read: its rows, or raw for a managed one."""
    from pipelines.arrow_batch import RAW_IDS

    managed = {f for names in (remap.features.values() if remap else ()) for f in names}
    return tuple(RAW_IDS if f in managed else rows for f, rows in zip(spec.feature_names, spec.table_sizes))

