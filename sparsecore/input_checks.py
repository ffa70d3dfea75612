"""The checks every entry point runs on sparse input before an id is narrowed or looked up, shared
so that each path refuses the same input with the same words: ``sparsecore.preprocess``, the
sharded EBC / EC (``torchrec_tpu.sharding``) and TorchRec's TPU module served by ``torch_tpu``
(which narrows ids to int32 itself, after these checks).

* :func:`checked_ids`: ids in their given form (any integer dtype, or float): each an integer
  inside the table's rows. A cast first would wrap 2^32 + 3 to 3 and truncate 1.5 to 1.
* :func:`jagged_batch`: a KeyedJaggedTensor's keys, sample counts and lengths against the
  features that read it; errors name the feature and the bad count.
* :func:`positive_int` and :func:`check_table_names`: the config checks (sizes, limits, duplicate
  tables, a feature in two tables).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:  # (torchrec is heavy to import; the specs use the config checks without it)
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

# floats represent every integer exactly below this
_EXACT_FLOAT_INTEGERS = 2**53
_INT64_MAX = 2**63 - 1


def positive_int(value: Any, what: str) -> int:
    """``value`` as an int when it is an integer >= 1 (Python or numpy; not bool, not 1.5), else
    ValueError naming ``what`` and the value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def check_table_names(tables: Iterable[tuple[str, Sequence[str]]], what: str = "table") -> None:
    """ValueError for a table name given twice or a feature listed by two tables (or twice by
    one); ``tables``: (table name, its feature names); ``what``: "table" or "stack"."""
    owner: dict[str, str] = {}
    seen: set[str] = set()
    for table, features in tables:
        if table in seen:
            raise ValueError(f"duplicate {what} name {table!r}: each {what} needs its own name")
        seen.add(table)
        for feature in features:
            if feature in owner:
                where = f"twice by {what} {table!r}" if owner[feature] == table else \
                    f"by {what}s {owner[feature]!r} and {table!r}"
                raise ValueError(f"feature {feature!r} is listed {where}: a feature looks up one table")
            owner[feature] = table


def _describe_rows(table_rows: int) -> str:
    return f"the table's {table_rows} rows [0, {table_rows})"


def integral_ids(values: np.ndarray, table_rows: int, where: str) -> np.ndarray:
    """``values`` as int64 ids: integers as they are, floats whose every value is an integer (not
    1.5, NaN or inf); anything else raises one ValueError naming ``where``, the first bad id and
    ``table_rows``. Unsigned ids beyond int64 are out of any table's range and raise here too."""
    if np.issubdtype(values.dtype, np.unsignedinteger):
        big = np.flatnonzero(values > _INT64_MAX)
        if big.size:
            raise ValueError(f"{where}: id {int(values[big[0]])} is outside {_describe_rows(table_rows)} "
                             f"(position {int(big[0])}; {big.size} ids out of range)")
        return values.astype(np.int64)
    if np.issubdtype(values.dtype, np.integer):
        return values.astype(np.int64, copy=False)
    if not np.issubdtype(values.dtype, np.floating):
        raise ValueError(f"{where}: ids must be integers, got dtype {values.dtype}")
    with np.errstate(invalid="ignore"):
        fractional = ~np.isfinite(values) | (values != np.round(values))
    if fractional.any():
        i = int(np.flatnonzero(fractional)[0])
        raise ValueError(f"{where}: id {values[i].item()!r} is not an integer (position {i}, dtype {values.dtype}; "
                         f"{int(fractional.sum())} non-integral ids); ids index {_describe_rows(table_rows)}")
    huge = np.flatnonzero(np.abs(values) >= _EXACT_FLOAT_INTEGERS)  # beyond any table, and int64 may not hold it
    if huge.size:
        raise ValueError(f"{where}: id {values[huge[0]].item()!r} is outside {_describe_rows(table_rows)} "
                         f"(position {int(huge[0])}; {huge.size} such ids)")
    return values.astype(np.int64)


def check_id_range(ids: np.ndarray, table_rows: int, where: str, hint: str = "") -> None:
    """ValueError naming ``where``, the first of the int64 ``ids`` outside ``[0, table_rows)``, its
    position and how many there are (then ``hint``); nothing when all fit."""
    outside = np.flatnonzero((ids < 0) | (ids >= table_rows))
    if outside.size:
        raise ValueError(f"{where}: id {int(ids[outside[0]])} is outside {_describe_rows(table_rows)} (position "
                         f"{int(outside[0])}; {outside.size} ids out of range){hint}")


def checked_ids(values: np.ndarray, table_rows: int, where: str) -> np.ndarray:
    """``values`` as int64 ids, each an integer in ``[0, table_rows)``; else ValueError naming
    ``where`` (the feature), the first bad id and the table's rows."""
    ids = integral_ids(values, table_rows, where)
    check_id_range(ids, table_rows, where)
    return ids


@dataclass(frozen=True)
class JaggedBatch:
    """A KJT's arrays on the host, checked by :func:`jagged_batch`: ``lengths`` is
    ``[keys, samples]``, ``value_ends[i]`` the end of key ``i``'s values; ``values`` keep their
    dtype (:func:`checked_ids` converts them)."""

    keys: list[str]
    values: np.ndarray
    lengths: np.ndarray
    weights: np.ndarray | None
    value_ends: np.ndarray

    def span(self, key: str) -> tuple[int, int]:
        """``[start, stop)`` of ``key``'s values."""
        i = self.keys.index(key)
        return (0 if i == 0 else int(self.value_ends[i - 1])), int(self.value_ends[i])

    def feature(self, key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(values, lengths, weights or None) of ``key``."""
        start, stop = self.span(key)
        weights = None if self.weights is None else self.weights[start:stop]
        return self.values[start:stop], self.lengths[self.keys.index(key)], weights


def _host(tensor: torch.Tensor, what: str) -> np.ndarray:
    if tensor.device.type != "cpu":
        raise ValueError(f"KJT {what} must be on the host (cpu) for preprocessing, got {tensor.device}")
    return tensor.detach().numpy()


def jagged_batch(kjt: KeyedJaggedTensor, features: Sequence[str], batch_sizes: Mapping[str, int],
                 other_keys: bool = False) -> JaggedBatch:
    """``kjt``'s arrays, checked against the ``features`` that read it (each with its expected
    sample count in ``batch_sizes``); ``other_keys``: keys no feature reads are allowed. One
    ValueError names the first problem: a missing feature (and the keys present), a repeated or
    unknown key, a feature's sample count, a negative length (feature, sample, value), lengths that
    do not sum to the values (feature, sum, value count), weights of another shape."""
    keys = list(kjt.keys())
    repeated = sorted({k for k in keys if keys.count(k) > 1}) if len(set(keys)) != len(keys) else []
    if repeated:
        raise ValueError(f"KJT keys {repeated} appear more than once in {keys}")
    missing = [f for f in features if f not in keys]
    if missing:
        raise ValueError(f"the KJT has no feature {missing[0]!r}" + (f" (nor {missing[1:]})" if missing[1:] else "")
                         + f"; its features are {keys}")
    wanted = set(features)
    unknown = [k for k in keys if k not in wanted]
    if unknown and not other_keys:
        raise ValueError(f"KJT keys {unknown} are not features of these tables (features: {list(features)})")
    if kjt.variable_stride_per_key():
        raise ValueError("variable-batch KJTs (stride per key) are not supported")
    values = _host(kjt.values(), "values")
    lengths = _host(kjt.lengths(), "lengths").astype(np.int64, copy=False)
    weights_t = kjt.weights_or_none()
    weights = None if weights_t is None else _host(weights_t, "weights").astype(np.float32, copy=False)
    if values.ndim != 1 or lengths.ndim != 1:
        raise ValueError(f"KJT values and lengths must be 1-D, got shapes {values.shape} and {lengths.shape}")
    stride = kjt.stride()
    if lengths.size != stride * len(keys):
        raise ValueError(f"KJT has {lengths.size} lengths for {len(keys)} features x {stride} samples: one length "
                         "per sample of each feature")
    for name in features:
        if stride != batch_sizes[name]:
            raise ValueError(f"feature {name!r}: lengths for {stride} samples, expected {batch_sizes[name]} "
                             "(the batch size)")
    per_key = lengths.reshape(len(keys), stride)
    if lengths.size and lengths.min() < 0:
        i, sample = divmod(int(np.flatnonzero(lengths < 0)[0]), max(stride, 1))
        raise ValueError(f"feature {keys[i]!r}: sample {sample} has length {int(per_key[i, sample])}; a length "
                         "counts the sample's ids (>= 0)")
    sums = per_key.sum(axis=1)
    value_ends = np.cumsum(sums)
    total = int(value_ends[-1]) if keys else 0
    if total != values.size:
        past = np.flatnonzero(value_ends > values.size)
        i = int(past[0]) if past.size else len(keys) - 1
        raise ValueError(f"feature {keys[i]!r}: lengths sum to {int(sums[i])} ({total} over all features "
                         f"{keys}) but the KJT has {values.size} values")
    if weights is not None and weights.shape != values.shape:
        raise ValueError(f"KJT weights shape {weights.shape} does not match values shape {values.shape}")
    return JaggedBatch(keys, values, per_key, weights, value_ends)
