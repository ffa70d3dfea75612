"""Which input rows ``infer`` scores, and which of them the checkpoint's run trained on.

A checkpoint's ``meta.json`` records its run's data split (``data_split``: per split, each file's
name, Parquet footer hash and rows; :meth:`torchrec_tpu.train.data.TrainData.split_record`). An
input file is matched to a split's file by footer hash, so a copy or a renamed file still matches
(checkpoints written before the split was recorded: nothing to check against).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from torchrec_tpu.inference.input_identity import footer_of
from torchrec_tpu.inference.units import Unit
from torchrec_tpu.train.checkpoint.dirs import META_FILE

TRAINED_SPLIT = "train"
SHOWN_FILES = 3  # files named in a line; more are counted


@dataclass(frozen=True)
class ScoredRows:
    """The inputs' rows by file, and how many of them lie in the checkpoint's training split."""

    files: tuple[tuple[str, int], ...]  # (input file as found under --data, rows)
    trained: tuple[tuple[str, int, int], ...]  # (file, first row, end) ranges the checkpoint trained on
    recorded: bool  # whether the checkpoint records its data split

    @property
    def rows(self) -> int:
        return sum(rows for _, rows in self.files)

    @property
    def trained_rows(self) -> int:
        return sum(end - first for _, first, end in self.trained)

    def describe(self) -> str:
        """``24,000 rows (row_id 0-23,999) of 6 files (a.parquet, b.parquet, c.parquet, ...)``."""
        ids = f" (row_id 0-{self.rows - 1:,})" if self.rows else ""
        return f"{self.rows:,} rows{ids} of " + _files_text([name for name, _ in self.files])

    def overlap_warning(self) -> str | None:
        """The warning when some inputs are rows the checkpoint trained on, else None."""
        if not self.trained:
            return None
        ranges = [f"{Path(name).name} rows {first:,}-{end - 1:,}" for name, first, end in self.trained[:SHOWN_FILES]]
        more = f" and {len(self.trained) - SHOWN_FILES} more file(s)" if len(self.trained) > SHOWN_FILES else ""
        return (f"{self.trained_rows:,} of the {self.rows:,} input rows are rows the checkpoint trained on "
                f"({', '.join(ranges)}{more}): an AUC over them is not a held-out score; point --data at "
                "the run's held-out files for one")


def _files_text(names: Sequence[str]) -> str:
    shown = ", ".join(Path(n).name for n in names[:SHOWN_FILES])
    more = ", ..." if len(names) > SHOWN_FILES else ""
    return f"{len(names)} file{'s' if len(names) != 1 else ''} ({shown}{more})"


def checkpoint_split(checkpoint: Path) -> dict[str, list[dict[str, Any]]] | None:
    """The ``data_split`` of the checkpoint's ``meta.json``; None when it has none (older
    checkpoints, npy days) or it is not in the recorded shape."""
    try:
        split = json.loads((checkpoint / META_FILE).read_text()).get("data_split")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(split, dict) or not all(isinstance(v, list) for v in split.values()) or not split:
        return None
    return split


def scored_rows(units: Sequence[Unit], split: dict[str, list[dict[str, Any]]] | None) -> ScoredRows:
    """The rows of ``units`` (file order) against the checkpoint's ``split``."""
    rows: dict[str, int] = defaultdict(int)
    footers: dict[str, str] = {}
    for unit in units:
        rows[unit.path] += unit.num_rows
        footers[unit.path] = footer_of(unit.input_id)
    trained_by_footer: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for entry in (split or {}).get(TRAINED_SPLIT, []):
        try:
            first, end = (int(r) for r in entry["rows"])
            trained_by_footer[str(entry["footer_sha256"])].append((first, end))
        except (KeyError, TypeError, ValueError):
            continue  # not the recorded shape: nothing to match
    trained = []
    for path, count in rows.items():
        for first, end in trained_by_footer.get(footers[path], []):
            first, end = max(first, 0), min(end, count)
            if first < end:
                trained.append((path, first, end))
    return ScoredRows(tuple(rows.items()), tuple(trained), split is not None)
