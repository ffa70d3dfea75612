"""Readers of public interaction logs into :class:`Events`.

- MovieLens ratings: ml-1m ``ratings.dat`` (``UserID::MovieID::Rating::Timestamp``) or ml-20m /
  ml-25m ``ratings.csv`` (header ``userId,movieId,rating,timestamp``; the bundled sample's
  ``user_id,movie_id,...`` too). Action: the rating in half stars (0..10); task ``positive``:
  rating >= 4.
- Yambda (Yandex's music events; MLPerf DLRMv4's data), Parquet with ``uid``, ``item_id``,
  ``timestamp``, ``event_type`` and ``played_ratio_pct`` (or ``played_ratio`` as a fraction).
  Action: the event type (listen, like, dislike, unlike, undislike: 0..4); tasks ``listen_plus``
  (a listen played at least half through) and ``like``.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.sequences.events import Events

MOVIELENS_ACTIONS = 11  # ratings 0..5 in half stars
YAMBDA_EVENT_TYPES = ("listen", "like", "dislike", "unlike", "undislike")
_ML_COLUMNS = {"user": ("userId", "user_id"), "item": ("movieId", "movie_id"), "rating": ("rating",),
               "timestamp": ("timestamp",)}


def _movielens_columns(path: Path) -> dict[str, np.ndarray]:
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        first = f.readline()
        f.seek(0)
        if "::" in first:
            rows = [line.rstrip("\n").split("::") for line in f if line.strip()]
            if any(len(r) != 4 for r in rows):
                bad = next(i for i, r in enumerate(rows) if len(r) != 4)
                raise ValueError(f"{path}: line {bad + 1} is not UserID::MovieID::Rating::Timestamp")
            table = list(zip(*rows)) if rows else [(), (), (), ()]
            return {name: np.asarray(table[i], dtype=np.float64 if name == "rating" else np.int64)
                    for i, name in enumerate(("user", "item", "rating", "timestamp"))}
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        names = {}
        for name, options in _ML_COLUMNS.items():
            found = [o for o in options if o in header]
            if not found:
                raise ValueError(f"{path}: no {' or '.join(options)} column in the header {header}")
            names[name] = found[0]
        rows = list(reader)
    try:
        return {name: np.asarray([r[col] for r in rows], dtype=np.float64 if name == "rating" else np.int64)
                for name, col in names.items()}
    except ValueError as error:
        raise ValueError(f"{path}: a non-numeric rating row ({error})") from None


def read_movielens(path: Path) -> Events:
    """MovieLens ratings (module docstring) as events."""
    cols = _movielens_columns(Path(path))
    rating = cols["rating"]
    if rating.size and (rating.min() < 0 or rating.max() > 5):
        raise ValueError(f"{path}: ratings outside [0, 5] (found {rating.min()}..{rating.max()})")
    return Events(user=cols["user"], item=cols["item"], action=np.rint(rating * 2).astype(np.int64),
                  timestamp=cols["timestamp"], labels={"positive": (rating >= 4).astype(np.float32)},
                  action_rows=MOVIELENS_ACTIONS, source=f"movielens:{Path(path).name}")


def _event_codes(column, path: Path) -> np.ndarray:
    if not (pa.types.is_integer(column.type)):
        names = np.asarray(column.cast("string").to_pylist(), dtype=object)
        codes = np.full(names.shape, -1, dtype=np.int64)
        for code, name in enumerate(YAMBDA_EVENT_TYPES):
            codes[names == name] = code
        if (codes < 0).any():
            raise ValueError(f"{path}: unknown event_type {names[codes < 0][0]!r}; expected {list(YAMBDA_EVENT_TYPES)}")
        return codes
    codes = column.to_numpy().astype(np.int64)
    if codes.size and (codes.min() < 0 or codes.max() >= len(YAMBDA_EVENT_TYPES)):
        raise ValueError(f"{path}: event_type codes outside [0, {len(YAMBDA_EVENT_TYPES)})")
    return codes


def read_yambda(path: Path) -> Events:
    """Yambda Parquet (a file or a directory of them; module docstring) as events."""
    table = pq.read_table(path)
    names = set(table.column_names)
    missing = sorted({"uid", "item_id", "timestamp", "event_type"} - names)
    if not names & {"played_ratio_pct", "played_ratio"}:
        missing.append("played_ratio_pct (or played_ratio)")
    if missing:
        raise ValueError(f"{path}: not Yambda events; columns missing: {missing}")
    codes = _event_codes(table.column("event_type").combine_chunks(), Path(path))
    if "played_ratio_pct" in names:
        played = pc.fill_null(table.column("played_ratio_pct"), 0).to_numpy().astype(np.float64) / 100.0
    else:
        played = pc.fill_null(table.column("played_ratio"), 0).to_numpy().astype(np.float64)
    listen_plus = (codes == YAMBDA_EVENT_TYPES.index("listen")) & (played >= 0.5)
    like = codes == YAMBDA_EVENT_TYPES.index("like")
    ints = {c: table.column(c).to_numpy().astype(np.int64) for c in ("uid", "item_id", "timestamp")}
    return Events(user=ints["uid"], item=ints["item_id"], action=codes, timestamp=ints["timestamp"],
                  labels={"listen_plus": listen_plus.astype(np.float32), "like": like.astype(np.float32)},
                  action_rows=len(YAMBDA_EVENT_TYPES), source=f"yambda:{Path(path).name}")
