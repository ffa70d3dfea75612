"""TorchRec's preprocessed ("in-memory binary") Criteo: ``day_<d>_{dense,sparse,labels}.npy``.

The layout ``torchrec/datasets/scripts/npy_preproc_criteo.py`` writes (TorchRec's
``InMemoryBinaryCriteoIterDataPipe`` reads it): per day, dense float32 [N, 13] already
log-transformed, sparse integer ids [N, 26], labels integer [N, 1]. Ids are hashed modulo the table
sizes when a batch is built; the dense values are used as stored. Batches are dealt to the ranks as
TorchRec deals them: global batch i (rows [i*B, (i+1)*B) of the days in order) goes to rank
i mod world_size, so one step trains on W*B consecutive rows; without ``drop_last`` the rows after
the last full round are split over the ranks in order (a rank left no row gets no last batch).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipelines.bad_values import BadValueLog
from pipelines.schema import CRITEO
from pipelines.streams import BatchStream

_DAY = re.compile(r"day_(\d+)_dense\.npy")
PARTS = ("dense", "sparse", "labels")


def npy_days(directory: str | Path) -> list[int]:
    """The day numbers with all three npy files in ``directory``, ascending."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such directory (expected day_<d>_dense.npy etc.)")
    days = sorted(int(m.group(1)) for p in directory.iterdir() if (m := _DAY.fullmatch(p.name)))
    for day in days:
        missing = [part for part in PARTS if not (directory / f"day_{day}_{part}.npy").is_file()]
        if missing:
            raise FileNotFoundError(f"{directory}: day {day} has no {', '.join(f'day_{day}_{m}.npy' for m in missing)}")
    if not days:
        raise FileNotFoundError(f"{directory}: no day_<d>_dense.npy files (TorchRec's npy_preproc_criteo layout)")
    return days


def rank_spans(num_rows: int, batch_size: int, rank: int, world_size: int,
                drop_last: bool) -> list[tuple[int, int]]:
    """[lo, hi) global rows of each batch of ``rank``, in order (TorchRec's dealing)."""
    full = num_rows // batch_size // world_size * world_size
    spans = [(i * batch_size, (i + 1) * batch_size) for i in range(rank, full, world_size)]
    rest = num_rows - full * batch_size
    sizes = [rest // world_size + (r < rest % world_size) for r in range(world_size)]
    if not drop_last and sizes[rank]:
        lo = full * batch_size + sum(sizes[:rank])
        spans.append((lo, lo + sizes[rank]))
    return spans


class NpyCriteoReader(BatchStream):
    """Batches of ``batch_size`` rows over ``days`` of ``directory``, this rank's rows only.

    ``mmap_mode``: memory-map the files (TorchRec's ``--mmap_mode``) instead of loading them.
    """

    def __init__(self, directory: str | Path, days: Sequence[int], batch_size: int, table_sizes: Sequence[int],
                 rank: int = 0, world_size: int = 1, drop_last: bool = False, mmap_mode: bool = False) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        if len(table_sizes) != len(CRITEO.sparse):
            raise ValueError(f"need {len(CRITEO.sparse)} table sizes, got {len(table_sizes)}")
        directory = Path(directory)
        self.files = [directory / f"day_{d}_dense.npy" for d in days]
        self.batch_size, self.table_sizes = batch_size, tuple(table_sizes)
        self.bad_value_log = BadValueLog()  # stays empty: the values are used as TorchRec stored them
        mode = "r" if mmap_mode else None
        self._parts = [{part: np.load(directory / f"day_{d}_{part}.npy", mmap_mode=mode) for part in PARTS}
                       for d in days]
        for day, part in zip(days, self._parts):
            self._check(directory, day, part)
        self._first_rows = np.cumsum([0] + [len(p["labels"]) for p in self._parts])
        self.num_rows = int(self._first_rows[-1])
        self.spans = rank_spans(self.num_rows, batch_size, rank, world_size, drop_last)
        share = self.num_rows // world_size + (rank < self.num_rows % world_size)
        self.rows_dropped = share - sum(hi - lo for lo, hi in self.spans)

    @staticmethod
    def _check(directory: Path, day: int, part: dict[str, np.ndarray]) -> None:
        rows = len(part["labels"])
        shapes = {"dense": (rows, len(CRITEO.dense)), "sparse": (rows, len(CRITEO.sparse))}
        for name, shape in shapes.items():
            if part[name].shape != shape:
                raise ValueError(f"{directory / f'day_{day}_{name}.npy'}: shape {part[name].shape}, "
                                 f"expected {shape} (rows of day_{day}_labels.npy x features)")
        if part["labels"].shape not in ((rows,), (rows, 1)):
            raise ValueError(f"{directory / f'day_{day}_labels.npy'}: shape {part['labels'].shape}, expected [N, 1]")

    def __len__(self) -> int:
        return len(self.spans)

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_from_row(0)

    def iter_from_row(self, row: int) -> Iterator[Batch]:
        """Batches from row ``row`` of this rank's range on."""
        if row < 0:
            raise ValueError(f"row must be >= 0, got {row}")
        done = 0
        for lo, hi in self.spans:
            if done >= row:
                yield self._batch(lo, hi)
            done += hi - lo

    def _rows(self, part: str, lo: int, hi: int) -> np.ndarray:
        pieces = []
        for index, first in enumerate(self._first_rows[:-1]):
            a, b = max(lo, first), min(hi, self._first_rows[index + 1])
            if a < b:
                pieces.append(np.asarray(self._parts[index][part][a - first:b - first]))
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def _batch(self, lo: int, hi: int) -> Batch:
        rows = hi - lo
        ids = np.mod(self._rows("sparse", lo, hi).astype(np.int64), np.asarray(self.table_sizes, dtype=np.int64))
        return Batch(
            dense_features=torch.from_numpy(np.ascontiguousarray(self._rows("dense", lo, hi), dtype=np.float32)),
            sparse_features=KeyedJaggedTensor(
                keys=list(CRITEO.sparse), values=torch.from_numpy(np.ascontiguousarray(ids.T).reshape(-1)),
                lengths=torch.ones(rows * len(CRITEO.sparse), dtype=torch.int32)),
            labels=torch.from_numpy(self._rows("labels", lo, hi).reshape(-1).astype(np.float32)),
        )
