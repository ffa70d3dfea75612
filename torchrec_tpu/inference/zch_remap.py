"""The frozen managed-collision remap of a ``train --zch`` checkpoint, for inference: raw ids go
to the rows training gave them, an id it never kept to its table's last row (TorchRec's default
slot for a miss); nothing is counted or evicted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchrec_tpu.sharding.zch import ZchSpec
from torchrec_tpu.sharding.zch_collection import ZchCollection
from torchrec_tpu.sharding.zch_tables import STATE_KEY, load_state_bytes
from torchrec_tpu.train.config import TrainConfig
from torchrec_tpu.train.model import EBC_PATH, ModelSpec, table_name

SAVED_KEY = f"{EBC_PATH}.{STATE_KEY}"  # in the checkpoint's model state


def saved_remap(meta: dict[str, Any], saved_keys: set[str], spec: ModelSpec,
                load: Callable[[str], bytes]) -> ZchCollection | None:
    """The remap a checkpoint holds (None: its tables take ids modulo their rows); ``saved_keys``:
    the keys of its DCP state, ``load(key)``: reads one plain value of the model's state."""
    if f"model.{SAVED_KEY}" not in saved_keys:
        return None
    managed = TrainConfig.from_options(**meta["config"]).engine.zch_tables(spec.feature_names)
    rows = dict(zip(spec.feature_names, spec.table_sizes))
    remap = ZchCollection({table_name(f): (rows[f], ZchSpec(policy, interval)) for f, (policy, interval)
                           in managed.items()}, {table_name(f): [f] for f in managed})
    load_state_bytes(remap, load(SAVED_KEY))
    return remap


def read_sizes(spec: ModelSpec, remap: ZchCollection | None) -> tuple[int, ...]:
    """What each feature's ids are taken modulo when read: its rows, or raw for a managed one."""
    from pipelines.arrow_batch import RAW_IDS

    managed = {f for names in (remap.features.values() if remap else ()) for f in names}
    return tuple(RAW_IDS if f in managed else rows for f, rows in zip(spec.feature_names, spec.table_sizes))

