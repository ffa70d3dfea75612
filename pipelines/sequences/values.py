"""The integer and label columns of event and sequence files, checked before anything trusts them.

:func:`int64_values` returns ids, action codes and timestamps as int64 and refuses what a cast would
change: a null (NaN after a float cast, -2^63 after an int cast), a non-integral or non-finite
float, a float beyond 2^53 (no longer an exact integer), an integer beyond int64, a value below the
column's minimum (ids are >= 0) or at or above its limit (a table's rows). Integral floats (``2.0``)
are accepted. :func:`check_labels` refuses labels outside ``[0, 1]``, NaN or null, with DLRM's
wording (:mod:`pipelines.bad_values`). Each refusal is one :class:`BadValueError` line naming the
file, the row (or line), the column, the value and the limit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipelines.bad_values import LABEL_WHY, BadValueError, bad_labels

FLOAT_EXACT = 2.0 ** 53  # floats at or beyond this no longer tell neighbouring integers apart
INT64_MAX = int(np.iinfo(np.int64).max)


@dataclass(frozen=True)
class Where:
    """Where value ``i`` of a column came from: ``{path}: {unit} {row_of(i)}``."""

    path: str
    unit: str = "row"
    row_of: Callable[[int], int] = int

    def __call__(self, index: int) -> str:
        return f"{self.path}: {self.unit} {self.row_of(index)}"

    @classmethod
    def of_lists(cls, path: str, offsets: np.ndarray, first_row: int = 0) -> "Where":
        """Value ``i`` of a list column's flat values lies in row ``searchsorted(offsets, i) - 1``
        of a table whose row 0 is row ``first_row`` of ``path``."""
        return cls(path, row_of=lambda i: first_row + int(np.searchsorted(offsets, i, side="right")) - 1)


@dataclass(frozen=True)
class Limit:
    """Values must lie below ``rows``; ``governed_by`` says what sets it (a flag, a file's field)."""

    rows: int
    governed_by: str


def _refuse(where: Where, index: int, column: str, value: object, why: str) -> BadValueError:
    return BadValueError(f"{where(index)}, column {column}: {'null' if value is None else repr(value)} {why}")


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _as_array(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    return values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values


def int64_values(values: pa.Array | pa.ChunkedArray, column: str, where: Where, *, minimum: int | None = 0,
                 limit: Limit | None = None) -> np.ndarray:
    """``values`` (integers, integral floats or timestamps) as int64; BadValueError otherwise (module docstring)."""
    array = _as_array(values)
    if array.null_count:
        index = _first(array.is_null().to_numpy(zero_copy_only=False))
        raise _refuse(where, index, column, None, "where an integer is needed (drop or fill such rows first)")
    kind = array.type
    if pa.types.is_timestamp(kind) or pa.types.is_date(kind) or pa.types.is_duration(kind):
        array, kind = array.cast(pa.int64()), pa.int64()
    if pa.types.is_integer(kind):
        raw = array.to_numpy(zero_copy_only=False)
        if raw.dtype == np.uint64 and raw.size and raw.max() > INT64_MAX:
            index = _first(raw > INT64_MAX)
            raise _refuse(where, index, column, int(raw[index]), f"is beyond int64's range (at most {INT64_MAX})")
        out = raw.astype(np.int64)
    elif pa.types.is_floating(kind):
        floats = array.to_numpy(zero_copy_only=False).astype(np.float64)
        bad = ~np.isfinite(floats) | (np.abs(floats) >= FLOAT_EXACT)
        bad[~bad] = floats[~bad] != np.floor(floats[~bad])
        if bad.any():
            index = _first(bad)
            raise _refuse(where, index, column, float(floats[index]),
                          "is not an integer (integral floats below 2^53 are accepted)")
        out = floats.astype(np.int64)
    else:
        raise BadValueError(f"{where.path}: column {column} holds {kind}, not integers")
    if minimum is not None and out.size and out.min() < minimum:
        index = _first(out < minimum)
        raise _refuse(where, index, column, int(out[index]), f"is below {minimum}; {column} must be >= {minimum}")
    if limit is not None and out.size and out.max() >= limit.rows:
        index = _first(out >= limit.rows)
        raise _refuse(where, index, column, int(out[index]),
                      f"is at or above {limit.rows:,} ({limit.governed_by})")
    return out


def parse_numbers(texts: Sequence[str | None], column: str, where: Where) -> pa.Array:
    """Decimal texts as an Arrow array (int64 when all are integers, else float64; None: null) for
    :func:`int64_values`; BadValueError naming the first text that is no number."""
    strings = pa.array([t.strip() if t is not None else None for t in texts], pa.string())
    for kind in (pa.int64(), pa.float64()):
        try:
            return strings.cast(kind)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            continue
    numbers: list[float | None] = []
    for index, text in enumerate(strings.to_pylist()):
        try:
            numbers.append(None if text is None else float(text))
        except ValueError:
            raise _refuse(where, index, column, text, "is not a number") from None
    return pa.array(numbers, pa.float64())


def check_labels(values: pa.Array | pa.ChunkedArray, column: str, where: Where) -> np.ndarray:
    """``values`` as float32 labels; BadValueError naming the first that is null, NaN or outside [0, 1]."""
    array = _as_array(values)
    if array.null_count:
        index = _first(array.is_null().to_numpy(zero_copy_only=False))
        raise _refuse(where, index, column, None, LABEL_WHY)
    if not (pa.types.is_floating(array.type) or pa.types.is_integer(array.type) or pa.types.is_boolean(array.type)):
        raise BadValueError(f"{where.path}: column {column} holds {array.type}, not labels in [0, 1]")
    labels = array.to_numpy(zero_copy_only=False).astype(np.float64)
    bad = bad_labels(labels)
    if bad.any():
        index = _first(bad)
        raise _refuse(where, index, column, float(labels[index]), LABEL_WHY)
    return labels.astype(np.float32)
