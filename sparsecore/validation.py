"""Host-side input checks: a KeyedJaggedTensor becomes validated per-feature numpy arrays.

Everything here runs before any id reaches a kernel. Out-of-range ids raise by default; the
explicit ``id_policy`` "hash" maps them into range (``id mod vocab``, non-negative) and "clip"
clamps them to ``[0, vocab - 1]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

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
                             "(sparsecore.validation.integer_ids converts integral float ids)")


# floats represent every integer exactly below this
_EXACT_FLOAT_INTEGERS = 2**53


def integer_ids(values: np.ndarray, where: str) -> np.ndarray:
    """``values`` as integer ids: integer arrays as they are, float arrays whose every value is an
    integer (finite, below 2^53) as int64; anything else raises one ValueError naming ``where``,
    the first bad value and its position (a cast would truncate 1.5 to 1)."""
    if np.issubdtype(values.dtype, np.integer):
        return values
    if not np.issubdtype(values.dtype, np.floating):
        raise ValueError(f"{where}: ids must be integers, got dtype {values.dtype}")
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(values) | (values != np.round(values)) | (np.abs(values) >= _EXACT_FLOAT_INTEGERS)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{where}: ids must be integers, got {values[i].item()!r} at position {i} "
                         f"(dtype {values.dtype}; {int(bad.sum())} non-integral ids)")
    return values.astype(np.int64)


def feature_inputs(
    kjt: KeyedJaggedTensor,
    features: Sequence[FeatureSpec],
    tables: Mapping[str, TableSpec],
    id_policy: str = "error",
) -> dict[str, FeatureInput]:
    """Split and check a KJT against the feature specs; returns inputs by feature name."""
    if id_policy not in ID_POLICIES:
        raise ValueError(f"id_policy must be one of {ID_POLICIES}, got {id_policy!r}")
    keys = list(kjt.keys())
    expected = [f.name for f in features]
    if sorted(keys) != sorted(expected) or len(set(keys)) != len(keys):
        unknown = sorted(set(keys) - set(expected))
        missing = sorted(set(expected) - set(keys))
        raise ValueError(f"KJT keys {keys} do not match the features: unknown {unknown}, missing {missing}")
    if kjt.variable_stride_per_key():
        raise ValueError("variable-batch KJTs (stride per key) are not supported")
    values = _numpy(kjt.values(), "values")
    lengths = _numpy(kjt.lengths(), "lengths").astype(np.int64, copy=False)
    weights_t = kjt.weights_or_none()
    weights = None if weights_t is None else _numpy(weights_t, "weights").astype(np.float32, copy=False)
    if values.ndim != 1 or lengths.ndim != 1:
        raise ValueError(f"KJT values and lengths must be 1-D, got shapes {values.shape} and {lengths.shape}")
    values = integer_ids(values, "KJT values")
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"KJT lengths must be >= 0, found {int(lengths.min())}")
    if int(lengths.sum()) != values.size:
        raise ValueError(f"KJT lengths sum to {int(lengths.sum())} but there are {values.size} values")
    if weights is not None and weights.shape != values.shape:
        raise ValueError(f"KJT weights shape {weights.shape} does not match values shape {values.shape}")
    stride = kjt.stride()
    if lengths.size != stride * len(keys):
        raise ValueError(f"KJT has {lengths.size} lengths for {len(keys)} keys x batch {stride}")
    by_name = {f.name: f for f in features}
    value_ends = np.cumsum(lengths.reshape(len(keys), stride).sum(axis=1))
    fast = _valid_batch([by_name[k] for k in keys], tables, values, lengths.reshape(len(keys), stride), weights,
                        value_ends)
    if fast is not None:
        return fast
    out = {}
    for i, key in enumerate(keys):
        start = 0 if i == 0 else int(value_ends[i - 1])
        stop = int(value_ends[i])
        feature_weights = None if weights is None else weights[start:stop]
        out[key] = _check_feature(
            by_name[key], tables[by_name[key].table], values[start:stop],
            lengths[i * stride:(i + 1) * stride], feature_weights, id_policy,
        )
    return out


def _valid_batch(features: list[FeatureSpec], tables: Mapping[str, TableSpec], values: np.ndarray,
                 lengths: np.ndarray, weights: np.ndarray | None,
                 value_ends: np.ndarray) -> dict[str, FeatureInput] | None:
    """The inputs by feature when every check passes, checked over the whole batch at once; None
    when something is off (the per-feature checks then name the first problem, or apply the
    id policy)."""
    stride = lengths.shape[1]
    limits = np.array([f.max_ids_per_sample or 0 for f in features])
    if any(f.batch_size != stride for f in features) or (weights is None and any(f.weighted for f in features)):
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
    if ids.size and ((ids < 0) | (ids >= table_rows)).any():
        return None
    starts = value_ends - counts
    return {f.name: FeatureInput(ids[a:b], lengths[i], weights[a:b])
            for i, (f, a, b) in enumerate(zip(features, starts.tolist(), value_ends.tolist()))}


def _numpy(tensor: torch.Tensor, what: str) -> np.ndarray:
    if tensor.device.type != "cpu":
        raise ValueError(f"KJT {what} must be on the host (cpu) for preprocessing, got {tensor.device}")
    return tensor.detach().numpy()


def _check_feature(
    feature: FeatureSpec,
    table: TableSpec,
    ids: np.ndarray,
    lengths: np.ndarray,
    weights: np.ndarray | None,
    id_policy: str,
) -> FeatureInput:
    where = f"feature {feature.name!r} (table {table.name!r})"
    if lengths.size != feature.batch_size:
        raise ValueError(f"{where}: batch size {lengths.size} != spec batch_size {feature.batch_size}")
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
    ids = ids.astype(np.int64, copy=False)
    if ids.size:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= table.vocab_size:
            ids = _apply_id_policy(ids, table.vocab_size, id_policy, where, low, high)
    return FeatureInput(ids, lengths, weights)


def _apply_id_policy(ids: np.ndarray, table_rows: int, policy: str, where: str, low: int, high: int) -> np.ndarray:
    if policy == "hash":
        return np.mod(ids, table_rows)
    if policy == "clip":
        return np.clip(ids, 0, table_rows - 1)
    bad = ids[(ids < 0) | (ids >= table_rows)]
    raise ValueError(
        f"{where}: {bad.size} ids outside [0, {table_rows}) (min {low}, max {high}, first bad {int(bad[0])}); "
        "pass id_policy='hash' or 'clip' to map them into range"
    )
