"""Host-side input checks: a KeyedJaggedTensor becomes validated per-feature numpy arrays.

Everything here runs before any id reaches a kernel. Out-of-range ids raise by default; the
explicit ``id_policy`` "hash" maps them into range (``id mod vocab``, non-negative) and "clip"
clamps them to ``[0, vocab - 1]``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore.input_checks import check_id_range, integral_ids, jagged_batch
from sparsecore.specs import FeatureSpec, TableSpec

ID_POLICIES = ("error", "hash", "clip")


@dataclass(frozen=True)
class FeatureInput:
    """One feature's batch: flat ids (int64), per-sample lengths and per-id weights (float32)."""

    ids: np.ndarray
    lengths: np.ndarray
    weights: np.ndarray

    def __post_init__(self) -> None:
        # both preprocessing engines would truncate float ids (1.5 -> 1): only integers get this far
        if not np.issubdtype(self.ids.dtype, np.integer):
            raise ValueError(f"FeatureInput ids must be an integer array, got dtype {self.ids.dtype} "
                             "(sparsecore.input_checks.checked_ids converts integral float ids)")


def feature_inputs(
    kjt: KeyedJaggedTensor,
    features: Sequence[FeatureSpec],
    tables: Mapping[str, TableSpec],
    id_policy: str = "error",
    raw_ids: Collection[str] = (),
) -> dict[str, FeatureInput]:
    """Split and check a KJT against the feature specs; returns inputs by feature name. The ids
    of the ``raw_ids`` features may be any int64 (raw ids a managed-collision remap maps later)."""
    if id_policy not in ID_POLICIES:
        raise ValueError(f"id_policy must be one of {ID_POLICIES}, got {id_policy!r}")
    by_name = {f.name: f for f in features}
    batch = jagged_batch(kjt, list(by_name), {f.name: f.batch_size for f in features})
    keys = batch.keys
    values = batch.values
    if not np.issubdtype(values.dtype, np.signedinteger):  # floats (1.5?) or unsigned ids: per feature
        values = np.concatenate([
            integral_ids(batch.feature(key)[0], tables[by_name[key].table].vocab_size, _where(by_name[key]))
            for key in keys]) if keys else values.astype(np.int64)
    fast = _valid_batch([by_name[k] for k in keys], tables, values, batch.lengths, batch.weights, batch.value_ends,
                        raw_ids)
    if fast is not None:
        return fast
    out = {}
    for i, key in enumerate(keys):
        start, stop = batch.span(key)
        feature_weights = None if batch.weights is None else batch.weights[start:stop]
        out[key] = _check_feature(by_name[key], tables[by_name[key].table], values[start:stop], batch.lengths[i],
                                  feature_weights, id_policy, key in raw_ids)
    return out


def _where(feature: FeatureSpec) -> str:
    return f"feature {feature.name!r} (table {feature.table!r})"


def _valid_batch(features: list[FeatureSpec], tables: Mapping[str, TableSpec], values: np.ndarray,
                 lengths: np.ndarray, weights: np.ndarray | None,
                 value_ends: np.ndarray, raw_ids: Collection[str]) -> dict[str, FeatureInput] | None:
    """The inputs by feature when every check passes, checked over the whole batch at once; None
    when something is off (the per-feature checks then name the first problem, or apply the
    id policy)."""
    stride = lengths.shape[1]
    limits = np.array([f.max_ids_per_sample or 0 for f in features])
    if weights is None and any(f.weighted for f in features):
        return None
    if stride and ((limits > 0) & (lengths.max(axis=1) > limits)).any():
        return None
    if weights is None:
        weights = np.ones(values.size, dtype=np.float32)
    elif not np.isfinite(weights).all():
        return None
    ids = values.astype(np.int64, copy=False)
    counts = np.diff(value_ends, prepend=0)
    table_rows = np.repeat(np.array([tables[f.table].vocab_size for f in features], dtype=np.int64), counts)
    out_of_range = (ids < 0) | (ids >= table_rows)
    if raw_ids:
        out_of_range &= np.repeat(np.array([f.name not in raw_ids for f in features]), counts)
    if out_of_range.any():
        return None
    starts = value_ends - counts
    return {f.name: FeatureInput(ids[a:b], lengths[i], weights[a:b])
            for i, (f, a, b) in enumerate(zip(features, starts.tolist(), value_ends.tolist()))}


def _check_feature(
    feature: FeatureSpec,
    table: TableSpec,
    ids: np.ndarray,
    lengths: np.ndarray,
    weights: np.ndarray | None,
    id_policy: str,
    raw: bool = False,
) -> FeatureInput:
    where = _where(feature)
    if feature.max_ids_per_sample is not None and lengths.size and lengths.max() > feature.max_ids_per_sample:
        raise ValueError(
            f"{where}: a sample has {int(lengths.max())} ids, above max_ids_per_sample {feature.max_ids_per_sample}"
        )
    if feature.weighted and weights is None:
        raise ValueError(f"{where} is weighted but the KJT carries no weights")
    if weights is None:
        weights = np.ones(ids.size, dtype=np.float32)
    elif not np.isfinite(weights).all():
        raise ValueError(f"{where}: weights contain NaN or inf")
    if not raw and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= table.vocab_size):
        ids = _apply_id_policy(ids, table.vocab_size, id_policy, where)
    return FeatureInput(ids, lengths, weights)


def _apply_id_policy(ids: np.ndarray, table_rows: int, policy: str, where: str) -> np.ndarray:
    if policy == "hash":
        return np.mod(ids, table_rows)
    if policy == "clip":
        return np.clip(ids, 0, table_rows - 1)
    check_id_range(ids, table_rows, where, hint="; pass id_policy='hash' or 'clip' to map them into range")
    return ids
