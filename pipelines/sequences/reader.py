"""Batches of a sequence window file (:mod:`.layout`) as HSTU reads them: a KeyedJaggedTensor of
the history and candidates (keys ``item, action, timestamp, candidate_item, candidate_timestamp``)
and the candidates' labels ``[candidates, tasks]`` (float32).

Histories keep their latest ``max_history`` events; item ids at or above ``item_rows`` are hashed
into the table (``id mod item_rows``, as a capped table takes them; the default, the dataset's own
``item_rows``, hashes nothing). Rows are split over ranks in contiguous blocks of whole batches.

A file is checked when it is opened (:func:`check_window`): ids, action codes and timestamps must be
integers (integral floats are read as such), item ids and action codes >= 0 (action codes below the
model's ``action_rows``), labels in ``[0, 1]`` with one per candidate, and (given ``max_seq_len``) a
row's kept history and candidates within ``max_seq_len`` events; anything else is refused in one
:class:`~pipelines.bad_values.BadValueError` line naming the file, row, column and value.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipelines.bad_values import BadValueError
from pipelines.sequences.layout import LABEL_PREFIX, LIST_COLUMNS
from pipelines.sequences.values import Limit, Where, check_labels, int64_values

FEATURE_KEYS = LIST_COLUMNS  # the KJT's keys, in order
_HISTORY = ("item", "action", "timestamp")


@dataclass(frozen=True)
class SequenceBatch:
    """One batch: ``features`` (KJT, stride = users) and ``labels [candidates, tasks]``."""

    features: KeyedJaggedTensor
    labels: torch.Tensor

    @property
    def users(self) -> int:
        return self.features.stride()

    @property
    def rows(self) -> int:
        """The batch's rows (its users): what a training loop counts its position in."""
        return self.users

    def to(self, device: torch.device | str) -> "SequenceBatch":
        """This batch on ``device`` (itself when it is there)."""
        if self.labels.device == torch.device(device):
            return self
        return SequenceBatch(self.features.to(torch.device(device)), self.labels.to(device))


def _lists(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [rows + 1], flat values) of a list column."""
    array = column.combine_chunks()
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = array.flatten().to_numpy(zero_copy_only=False)
    return offsets - offsets[0], values


def check_window(table: pa.Table, path: Path, tasks: Sequence[str], action_rows: int | None = None,
                 first_row: int = 0) -> None:
    """BadValueError naming the first bad value of a sequence window table (module docstring) whose
    row 0 is row ``first_row`` of ``path``."""
    offsets: dict[str, np.ndarray] = {}
    for key in FEATURE_KEYS:
        array = table.column(key).combine_chunks()
        if not pa.types.is_list(array.type):
            raise BadValueError(f"{path}: column {key} holds {array.type}, not lists")
        offsets[key] = array.offsets.to_numpy().astype(np.int64)
        ids = key in ("item", "candidate_item", "action")
        limit = Limit(action_rows, "the dataset's action_rows (meta.json)") if key == "action" and action_rows else None
        int64_values(array.flatten(), key, Where.of_lists(str(path), offsets[key] - offsets[key][0], first_row),
                     minimum=0 if ids else None, limit=limit)
    candidates = np.diff(offsets["candidate_item"])
    for task in tasks:
        name = LABEL_PREFIX + task
        array = table.column(name).combine_chunks()
        if not pa.types.is_list(array.type):
            raise BadValueError(f"{path}: column {name} holds {array.type}, not lists")
        label_offsets = array.offsets.to_numpy().astype(np.int64)
        counts = np.diff(label_offsets)
        if not np.array_equal(counts, candidates):
            row = int(np.flatnonzero(counts != candidates)[0])
            raise BadValueError(f"{path}: row {first_row + row}, column {name}: {int(counts[row])} labels for "
                                f"{int(candidates[row])} candidates (one label per candidate_item)")
        check_labels(array.flatten(), name, Where.of_lists(str(path), label_offsets - label_offsets[0], first_row))


def _check_lengths(table: pa.Table, path: Path, max_history: int, max_seq_len: int) -> None:
    """BadValueError naming the first row whose kept history and candidates exceed ``max_seq_len`` events."""
    history = np.minimum(table.column("item").combine_chunks().value_lengths().to_numpy(zero_copy_only=False),
                         max_history)
    candidates = table.column("candidate_item").combine_chunks().value_lengths().to_numpy(zero_copy_only=False)
    over = history + candidates > max_seq_len
    if over.any():
        row = int(np.flatnonzero(over)[0])
        raise BadValueError(f"{path}: row {row}, column candidate_item: {int(candidates[row])} candidates after "
                            f"{int(history[row])} history events make {int(history[row] + candidates[row])}, above "
                            f"the model's max_seq_len {max_seq_len} (more candidates than meta.json's)")


def _keep_last(offsets: np.ndarray, values: np.ndarray, keep: int) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.minimum(np.diff(offsets), keep)
    starts = offsets[1:] - lengths
    index = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths) + np.arange(lengths.sum())
    return lengths, values[index]


class SequenceReader:
    """Batches of ``batch_size`` rows of ``path`` (one window file) for rank ``rank`` of
    ``world_size``, tasks ``tasks`` (default: every ``label_*`` column, in file order),
    reshuffled per pass when ``shuffle_seed`` is given (pass ``epoch`` to :meth:`batches`)."""

    def __init__(self, path: Path, batch_size: int, *, max_history: int, item_rows: int | None = None,
                 action_rows: int | None = None, max_seq_len: int | None = None, tasks: Sequence[str] | None = None,
                 shuffle_seed: int | None = None, rank: int = 0, world_size: int = 1):
        if batch_size < 1 or max_history < 0:
            raise ValueError(f"SequenceReader: batch_size={batch_size} (>= 1), max_history={max_history} (>= 0)")
        self.table = pq.read_table(path)
        names = self.table.column_names
        missing = [c for c in LIST_COLUMNS if c not in names]
        if missing:
            raise ValueError(f"{path}: not a sequence window file; columns missing: {missing}")
        present = [c[len(LABEL_PREFIX):] for c in names if c.startswith(LABEL_PREFIX)]
        self.tasks = tuple(tasks) if tasks is not None else tuple(present)
        unknown = [t for t in self.tasks if t not in present]
        if unknown or not self.tasks:
            raise ValueError(f"{path}: tasks {unknown or '(none)'} not among the file's labels {present}")
        check_window(self.table, Path(path), self.tasks, action_rows)
        if max_seq_len is not None:
            _check_lengths(self.table, Path(path), max_history, max_seq_len)
        self.path, self.batch_size, self.max_history = Path(path), batch_size, max_history
        self.item_rows, self.shuffle_seed = item_rows, shuffle_seed
        per_rank = self.table.num_rows // world_size
        self.rows = np.arange(rank * per_rank, (rank + 1) * per_rank)

    def __len__(self) -> int:
        return -(-self.rows.size // self.batch_size)

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[SequenceBatch]:
        """The pass ``epoch``'s batches from its row ``start`` on (the rows it yielded before, at any
        batch size, are skipped: a resumed pass continues after the last row trained)."""
        if not 0 <= start <= self.rows.size:
            raise ValueError(f"{self.path}: cannot resume at row {start} of a pass of {self.rows.size} rows")
        rows = self.rows
        if self.shuffle_seed is not None:
            rows = np.random.default_rng([self.shuffle_seed, epoch]).permutation(rows)
        for first in range(start, rows.size, self.batch_size):
            yield self.batch(rows[first:first + self.batch_size])

    def __iter__(self) -> Iterator[SequenceBatch]:
        return self.batches()

    def batch(self, rows: np.ndarray) -> SequenceBatch:
        """The batch of file rows ``rows``."""
        return sequence_batch(self.table.take(pa.array(rows)), self.tasks, self.max_history, self.item_rows)


def sequence_batch(part: pa.Table, tasks: Sequence[str], max_history: int, item_rows: int | None = None
                   ) -> SequenceBatch:
    """The batch of the rows of ``part`` (a sequence window table), histories cut to their latest
    ``max_history`` events, items hashed into ``item_rows``; labels of ``tasks`` (none: ``[C, 0]``)."""
    lengths, values = [], []
    for key in FEATURE_KEYS:
        offsets, flat = _lists(part.column(key))
        if key in _HISTORY:
            length, flat = _keep_last(offsets, flat, max_history)
        else:
            length = np.diff(offsets)
        if key in ("item", "candidate_item") and item_rows is not None:
            flat = flat % item_rows
        lengths.append(length)
        values.append(flat.astype(np.int64))
    kjt = KeyedJaggedTensor(keys=list(FEATURE_KEYS), values=torch.from_numpy(np.concatenate(values)),
                            lengths=torch.from_numpy(np.concatenate(lengths).astype(np.int64)))
    candidates = int(lengths[FEATURE_KEYS.index("candidate_item")].sum())
    labels = np.stack([_lists(part.column(LABEL_PREFIX + t))[1] for t in tasks], axis=1) if tasks else \
        np.zeros((candidates, 0))
    return SequenceBatch(kjt, torch.from_numpy(labels.astype(np.float32)))
