"""``ZchCollection``: the managed-collision remap of a KJT's features, table by table, as
TorchRec's ``ManagedCollisionCollection`` over ``MCHManagedCollisionModule``s does it.

Each managed table's features are remapped together (their values side by side in the table's
feature order, the one stream TorchRec's collection gives the table's module); other features
pass through. A batch's evicted slots come back with its remapped KJT: their rows are reset
before its lookup, as TorchRec's sharded MC modules reset them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_tpu.sharding.zch import RemapMark, TableRemap, ZchSpec


class ZchCollection:
    """Remaps of ``tables`` (name -> (rows, spec)) looked up by ``features`` (table -> its
    feature names, in TorchRec's config order)."""

    def __init__(self, tables: Mapping[str, tuple[int, ZchSpec]], features: Mapping[str, Sequence[str]]):
        missing = sorted(set(tables) - set(features))
        if missing:
            raise ValueError(f"zch tables {missing} have no features")
        self.remaps = {name: TableRemap(rows, spec) for name, (rows, spec) in tables.items()}
        self.features = {name: list(features[name]) for name in tables}

    def __call__(self, kjt: KeyedJaggedTensor, training: bool = True,
                 ) -> tuple[KeyedJaggedTensor, dict[str, torch.Tensor]]:
        """``kjt`` with its managed features' ids remapped to slots, and the slots each table
        evicted on the way (only tables that evicted)."""
        keys = kjt.keys()
        unknown = sorted(f for names in self.features.values() for f in names if f not in keys)
        if unknown:
            raise ValueError(f"zch features {unknown} are not in the batch's features {keys}")
        values = kjt.values()
        if values.dtype != torch.int64:
            values = values.to(torch.int64)
        bounds = [0, *torch.tensor(kjt.length_per_key()).cumsum(0).tolist()]
        spans = {key: (bounds[i], bounds[i + 1]) for i, key in enumerate(keys)}
        slots, evicted = self.remap_ids({f: values[a:b] for f, (a, b) in spans.items()}, training)
        out = values.clone()
        for feature, value in slots.items():
            a, b = spans[feature]
            out[a:b] = value
        remapped = KeyedJaggedTensor(keys=keys, values=out, weights=kjt.weights_or_none(), lengths=kjt.lengths(),
                                     offsets=kjt.offsets(), stride=kjt.stride(),
                                     length_per_key=kjt.length_per_key())
        return remapped, evicted

    def remap_ids(self, ids: Mapping[str, torch.Tensor], training: bool = True,
                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The slots of the managed features' ``ids`` (feature -> int64 ids; each table's features
        are one stream, in its feature order), and the slots each table evicted on the way."""
        slots: dict[str, torch.Tensor] = {}
        evicted: dict[str, torch.Tensor] = {}
        for table, remap in self.remaps.items():
            parts = [ids[f] for f in self.features[table]]
            remapped = remap(parts[0] if len(parts) == 1 else torch.cat(parts), training)
            slots.update(zip(self.features[table], remapped.split([p.numel() for p in parts])))
            taken = remap.take_evicted()
            if taken is not None:
                evicted[table] = taken
        return slots, evicted

    def marks(self) -> dict[str, RemapMark]:
        """Every table's state now (:meth:`TableRemap.mark`)."""
        return {name: remap.mark() for name, remap in self.remaps.items()}

    def restore(self, marks: Mapping[str, RemapMark]) -> None:
        """Every table back to ``marks``."""
        for name, remap in self.remaps.items():
            remap.restore(marks[name])

    def state_dict(self, marks: Mapping[str, RemapMark] | None = None) -> dict[str, torch.Tensor]:
        """``<table>.<buffer>`` of every table's state now (or at ``marks``)."""
        return {f"{name}.{key}": value for name, remap in self.remaps.items()
                for key, value in remap.state_dict(marks[name] if marks else None).items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Install a :meth:`state_dict`."""
        for name, remap in self.remaps.items():
            prefix = f"{name}."
            remap.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
