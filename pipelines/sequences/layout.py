"""The sequence Parquet layout HSTU trains on, and the rows built from events in time windows.

A dataset directory holds ``meta.json`` and one file per time window, ``window-NNNN.parquet``;
windows split the events' time range into equal event counts. Each row is one user at one point:

- ``user`` (int64);
- ``item``, ``action``, ``timestamp`` (list<int64>): up to ``max_history`` events before the
  row's candidates, oldest first, from any earlier time (earlier windows included);
- ``candidate_item``, ``candidate_timestamp`` (list<int64>): the next ``candidates`` events of
  the user in this window (fewer at the end of the window);
- ``label_<task>`` (list<float32>): each candidate's label per task.

Training on window T and evaluating on T + 1 (MLPerf DLRMv4's protocol) is reading two files;
every row of window T + 1 sees only events before its candidates.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.sequences.events import Events

META_FILE = "meta.json"
LIST_COLUMNS = ("item", "action", "timestamp", "candidate_item", "candidate_timestamp")
LABEL_PREFIX = "label_"
PREDICTION_PREFIX = "prediction_"  # the score per task `torchrec-tpu infer` writes beside label_<task>


@dataclass(frozen=True)
class SequenceMeta:
    """What a sequence dataset holds: its tasks, vocabularies (``item_rows``: largest item id + 1),
    windows (``boundaries``: the first timestamp of each window after the first), row shape and source."""

    tasks: tuple[str, ...]
    item_rows: int
    action_rows: int
    windows: int
    boundaries: tuple[int, ...]
    max_history: int
    candidates: int
    rows: tuple[int, ...]
    source: str

    def to_json(self) -> str:
        return json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}, indent=1)


def window_path(directory: Path, window: int) -> Path:
    return Path(directory) / f"window-{window:04d}.parquet"


def read_meta(directory: Path) -> SequenceMeta:
    """The ``meta.json`` of a sequence dataset; FileNotFoundError / ValueError naming the directory."""
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: not a sequence dataset (no {META_FILE}; write one with "
                                f"`torchrec-tpu data sequences`)")
    try:
        raw = json.loads(path.read_text())
        return SequenceMeta(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: malformed sequence metadata ({error})") from None


def _boundaries(timestamps: np.ndarray, windows: int) -> np.ndarray:
    cuts = np.quantile(timestamps, np.arange(1, windows) / windows, method="lower") if windows > 1 else []
    return np.unique(np.asarray(cuts, dtype=np.int64) + 1)


def _user_rows(order: np.ndarray, window_of: np.ndarray, window: int, max_history: int, candidates: int):
    """(history index, candidate index) pairs of one user's time-ordered events ``order`` in ``window``."""
    positions = np.flatnonzero(window_of[order] == window)
    for start in range(0, positions.size, candidates):
        chunk = positions[start:start + candidates]
        first = int(chunk[0])
        yield order[max(0, first - max_history):first], order[chunk]


def _table(events: Events, pairs: list[tuple[int, np.ndarray, np.ndarray]]) -> pa.Table:
    def lists(source: np.ndarray, which: int, dtype) -> pa.Array:
        parts = [source[p[which]] for p in pairs]
        offsets = np.zeros(len(parts) + 1, dtype=np.int32)
        offsets[1:] = np.cumsum([len(x) for x in parts])
        flat = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))

    columns = {"user": pa.array(np.array([p[0] for p in pairs], dtype=np.int64)),
               "item": lists(events.item, 1, np.int64), "action": lists(events.action, 1, np.int64),
               "timestamp": lists(events.timestamp, 1, np.int64),
               "candidate_item": lists(events.item, 2, np.int64),
               "candidate_timestamp": lists(events.timestamp, 2, np.int64)}
    for task, labels in events.labels.items():
        columns[LABEL_PREFIX + task] = lists(labels, 2, np.float32)
    return pa.table(columns)


def write_sequences(events: Events, directory: Path, *, windows: int = 4, max_history: int = 200,
                    candidates: int = 1) -> SequenceMeta:
    """Write ``events`` as a sequence dataset in ``directory`` (created; must not hold a dataset)."""
    for name, value in (("windows", windows), ("max_history", max_history), ("candidates", candidates)):
        if value < 1:
            raise ValueError(f"sequence layout: {name}={value}; it must be >= 1")
    if len(events) == 0:
        raise ValueError(f"{events.source}: no events to write")
    directory = Path(directory)
    if (directory / META_FILE).exists():
        raise FileExistsError(f"{directory} already holds a sequence dataset; choose an empty directory")
    directory.mkdir(parents=True, exist_ok=True)
    boundaries = _boundaries(events.timestamp, windows)
    window_of = np.searchsorted(boundaries, events.timestamp, side="right")
    by_user = np.lexsort((events.timestamp, events.user))
    splits = np.flatnonzero(np.diff(events.user[by_user])) + 1
    users = np.split(by_user, splits)
    counts = []
    for window in range(len(boundaries) + 1):
        pairs = [(int(events.user[order[0]]), hist, cand) for order in users
                 for hist, cand in _user_rows(order, window_of, window, max_history, candidates)]
        pq.write_table(_table(events, pairs), window_path(directory, window))
        counts.append(len(pairs))
    meta = SequenceMeta(tasks=tuple(events.labels), item_rows=int(events.item.max()) + 1,
                        action_rows=events.action_rows, windows=len(counts),
                        boundaries=tuple(int(b) for b in boundaries),
                        max_history=max_history, candidates=candidates, rows=tuple(counts), source=events.source)
    (directory / META_FILE).write_text(meta.to_json())
    return meta
