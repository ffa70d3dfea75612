"""``torchrec.experimental.torch_tpu.datasets.fdo.fdo_client``: per-step SparseCore input stats and
the FDO client interface (record every step, publish to storage, load the merge of all processes)."""

from __future__ import annotations

import abc
import dataclasses
import os
import re
import time
from pathlib import Path


@dataclasses.dataclass
class SparseCoreInputStats:
    """One stacked table's demand: ids dropped, and the most (unique) ids any partition got."""

    dropped_count: int = 0
    observed_max_ids: int = 0
    observed_max_unique_ids: int = 0


class KeyedSparseCoreInputStats:
    """:class:`SparseCoreInputStats` by (stacked) table name."""

    def __init__(self, table_stats: dict[str, SparseCoreInputStats]) -> None:
        self.table_stats = table_stats


class FDOClient(abc.ABC):
    """A process's feedback-directed-optimisation client: ``record`` each step's stats in memory,
    ``publish`` them to storage, ``load`` the stats merged over every process."""

    @abc.abstractmethod
    def record(self, data: KeyedSparseCoreInputStats) -> None:
        """Fold one step's stats into this process's running maxima and drop counts."""

    @abc.abstractmethod
    def publish(self) -> None:
        """Write this process's stats to the storage location."""

    @abc.abstractmethod
    def load(self) -> KeyedSparseCoreInputStats:
        """The latest published stats of every process, merged (max of maxima, sum of drops)."""


class BaseFileFDOClient(FDOClient):
    """An FDO client storing one file per publish, ``fdo_stats_<process>_<time ns>.<ext>`` in
    ``base_dir``; ``load`` reads each process's newest file."""

    _FILE_NAME = "fdo_stats"
    _FILE_EXTENSION = ""

    def __init__(self, base_dir: str | os.PathLike, process_id: int = 0,
                 initial_stats: KeyedSparseCoreInputStats | None = None) -> None:
        self._base_dir = Path(base_dir)
        self._process_id = process_id
        self._observed_max_ids: dict[str, int] = {}
        self._observed_max_unique_ids: dict[str, int] = {}
        self._dropped_counts: dict[str, int] = {}
        if initial_stats is not None:
            self.record(initial_stats)

    def record(self, data: KeyedSparseCoreInputStats) -> None:
        for name, stats in data.table_stats.items():
            self._observed_max_ids[name] = max(self._observed_max_ids.get(name, 0), stats.observed_max_ids)
            self._observed_max_unique_ids[name] = max(self._observed_max_unique_ids.get(name, 0),
                                                      stats.observed_max_unique_ids)
            self._dropped_counts[name] = self._dropped_counts.get(name, 0) + stats.dropped_count

    def _generate_file_name(self) -> str:
        name = f"{self._FILE_NAME}_{self._process_id}_{time.time_ns()}.{self._FILE_EXTENSION}"
        return os.fspath(self._base_dir / name)

    def _get_latest_files_by_process(self, files: list[str]) -> list[str]:
        """The newest of ``files`` for each process id in their names."""
        pattern = re.compile(rf"{self._FILE_NAME}_(\d+)_(\d+)\.{re.escape(self._FILE_EXTENSION)}$")
        newest: dict[str, tuple[int, str]] = {}
        for file in files:
            match = pattern.search(os.path.basename(file))
            if match:
                process, stamp = match.group(1), int(match.group(2))
                if process not in newest or stamp > newest[process][0]:
                    newest[process] = (stamp, file)
        return [file for _, file in newest.values()]
