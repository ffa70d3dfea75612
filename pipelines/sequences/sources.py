"""Readers of public interaction logs into :class:`Events`.

- MovieLens ratings: ml-1m ``ratings.dat`` (``UserID::MovieID::Rating::Timestamp``) or ml-20m /
  ml-25m ``ratings.csv`` (header ``userId,movieId,rating,timestamp``; the bundled sample's
  ``user_id,movie_id,...`` too). Action: the rating in half stars (0..10); task ``positive``:
  rating >= 4.
- Yambda (Yandex's music events; MLPerf DLRMv4's data), Parquet with ``uid``, ``item_id``,
  ``timestamp``, ``event_type`` and ``played_ratio_pct`` (or ``played_ratio`` as a fraction).
  Action: the event type (listen, like, dislike, unlike, undislike: 0..4); tasks ``listen_plus``
  (a listen played at least half through) and ``like``.

Ids and timestamps are checked as they are read (:mod:`.values`): a null, NaN, fractional or
negative one, or an item id at or above ``max_item_rows`` (the item table's rows, ``data sequences
--max-item-rows``, default :data:`MAX_ITEM_ROWS`), is refused naming the file, row (or line) and column.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from pipelines.bad_values import BadValueError
from pipelines.sequences.events import Events
from pipelines.sequences.values import Limit, Where, int64_values, parse_numbers

MOVIELENS_ACTIONS = 11  # ratings 0..5 in half stars
YAMBDA_EVENT_TYPES = ("listen", "like", "dislike", "unlike", "undislike")
MAX_ITEM_ROWS = 2 ** 24  # default cap on item ids (the item table's rows); Yambda's ~9.4M items fit
_ML_COLUMNS = {"user": ("userId", "user_id"), "item": ("movieId", "movie_id"), "rating": ("rating",),
               "timestamp": ("timestamp",)}
_ML_1M_NAMES = {"user": "UserID", "item": "MovieID", "rating": "Rating", "timestamp": "Timestamp"}


def item_limit(max_item_rows: int) -> Limit:
    """The bound on item ids: the item table's rows, ``--max-item-rows``."""
    return Limit(max_item_rows, "the item table's rows; raise `torchrec-tpu data sequences --max-item-rows` "
                                "or remap the ids")


def _movielens_texts(path: Path) -> tuple[dict[str, list], dict[str, str], list[int]]:
    """({field: texts}, {field: the file's column name}, the line number of each row)."""
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        first = f.readline()
        f.seek(0)
        if "::" in first:
            numbered = [(n, line.rstrip("\n").split("::")) for n, line in enumerate(f, 1) if line.strip()]
            bad = next((n for n, fields in numbered if len(fields) != 4), None)
            if bad is not None:
                raise ValueError(f"{path}: line {bad} is not UserID::MovieID::Rating::Timestamp")
            table = list(zip(*(fields for _, fields in numbered))) if numbered else [()] * 4
            return ({name: list(table[i]) for i, name in enumerate(_ML_1M_NAMES)}, _ML_1M_NAMES,
                    [n for n, _ in numbered])
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        names = {}
        for name, options in _ML_COLUMNS.items():
            found = [o for o in options if o in header]
            if not found:
                raise ValueError(f"{path}: no {' or '.join(options)} column in the header {header}")
            names[name] = found[0]
        texts: dict[str, list] = {name: [] for name in names}
        lines = []
        for row in reader:
            lines.append(reader.line_num)
            for name, column in names.items():
                texts[name].append(row[column])
    return texts, names, lines


def read_movielens(path: Path, max_item_rows: int = MAX_ITEM_ROWS) -> Events:
    """MovieLens ratings (module docstring) as events; BadValueError naming the line and column of
    an id that is no integer (or >= ``max_item_rows``), a rating outside [0, 5], a bad timestamp."""
    texts, names, lines = _movielens_texts(Path(path))
    where = Where(str(path), "line", row_of=lambda i: lines[i])

    def ints(field: str, **bounds) -> np.ndarray:
        return int64_values(parse_numbers(texts[field], names[field], where), names[field], where, **bounds)

    user, item = ints("user"), ints("item", limit=item_limit(max_item_rows))
    timestamp = ints("timestamp", minimum=None)
    rating = parse_numbers(texts["rating"], names["rating"], where).to_numpy(zero_copy_only=False).astype(np.float64)
    bad = ~((rating >= 0) & (rating <= 5))
    if bad.any():
        index = int(np.flatnonzero(bad)[0])
        raise BadValueError(f"{where(index)}, column {names['rating']}: {float(rating[index])!r} is not a rating "
                            "in [0, 5]")
    return Events(user=user, item=item, action=np.rint(rating * 2).astype(np.int64),
                  timestamp=timestamp, labels={"positive": (rating >= 4).astype(np.float32)},
                  action_rows=MOVIELENS_ACTIONS, source=f"movielens:{Path(path).name}")


def _event_codes(column: pa.Array, where: Where) -> np.ndarray:
    """Yambda's ``event_type`` (names, or their codes 0..4) as codes; BadValueError naming the first unknown."""
    if pa.types.is_integer(column.type) or pa.types.is_floating(column.type):
        return int64_values(column, "event_type", where,
                            limit=Limit(len(YAMBDA_EVENT_TYPES), f"the event types {list(YAMBDA_EVENT_TYPES)}"))
    names = np.asarray(column.cast(pa.string()).to_pylist(), dtype=object)
    codes = np.full(names.shape, -1, dtype=np.int64)
    for code, name in enumerate(YAMBDA_EVENT_TYPES):
        codes[names == name] = code
    if (codes < 0).any():
        index = int(np.flatnonzero(codes < 0)[0])
        raise BadValueError(f"{where(index)}, column event_type: unknown event_type {names[index]!r}; expected "
                            f"{list(YAMBDA_EVENT_TYPES)}")
    return codes


def _yambda_file(path: Path, max_item_rows: int) -> dict[str, np.ndarray]:
    """One Yambda Parquet file's columns: uid, item_id, timestamp, action codes, listen_plus, like."""
    table = pq.read_table(path)
    names = set(table.column_names)
    missing = sorted({"uid", "item_id", "timestamp", "event_type"} - names)
    if not names & {"played_ratio_pct", "played_ratio"}:
        missing.append("played_ratio_pct (or played_ratio)")
    if missing:
        raise ValueError(f"{path}: not Yambda events; columns missing: {missing}")
    where = Where(str(path))
    codes = _event_codes(table.column("event_type").combine_chunks(), where)
    if "played_ratio_pct" in names:
        played = pc.fill_null(table.column("played_ratio_pct"), 0).to_numpy().astype(np.float64) / 100.0
    else:
        played = pc.fill_null(table.column("played_ratio"), 0).to_numpy().astype(np.float64)
    return {"uid": int64_values(table.column("uid"), "uid", where),
            "item_id": int64_values(table.column("item_id"), "item_id", where, limit=item_limit(max_item_rows)),
            "timestamp": int64_values(table.column("timestamp"), "timestamp", where, minimum=None),
            "action": codes,
            "listen_plus": (codes == YAMBDA_EVENT_TYPES.index("listen")) & (played >= 0.5),
            "like": codes == YAMBDA_EVENT_TYPES.index("like")}


def read_yambda(path: Path, max_item_rows: int = MAX_ITEM_ROWS) -> Events:
    """Yambda Parquet (a file or a directory of them; module docstring) as events; BadValueError
    naming the file, row and column of a null, non-integral or negative id or timestamp, or an item
    id >= ``max_item_rows``."""
    files = [Path(f) for f in ds.dataset(path, format="parquet").files] if Path(path).is_dir() else [Path(path)]
    if not files:
        raise ValueError(f"{path}: no Parquet files")
    parts = [_yambda_file(f, max_item_rows) for f in files]
    col = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    return Events(user=col["uid"], item=col["item_id"], action=col["action"], timestamp=col["timestamp"],
                  labels={"listen_plus": col["listen_plus"].astype(np.float32), "like": col["like"].astype(np.float32)},
                  action_rows=len(YAMBDA_EVENT_TYPES), source=f"yambda:{Path(path).name}")
