"""``torchrec.experimental.torch_tpu.datasets.fdo.csv_file_fdo_client``: FDO stats as CSV files."""

from __future__ import annotations

import csv
import logging

from torchrec_tpu.experimental.datasets.fdo.fdo_client import (
    BaseFileFDOClient,
    KeyedSparseCoreInputStats,
    SparseCoreInputStats,
)

logger = logging.getLogger(__name__)
_COLUMNS = ["table_name", "max_ids", "max_unique_ids", "dropped_count"]


class CSVFileFDOClient(BaseFileFDOClient):
    """FDO client writing one CSV per publish: ``table_name,max_ids,max_unique_ids,dropped_count``."""

    _FILE_EXTENSION = "csv"

    def publish(self) -> None:
        self._base_dir.mkdir(parents=True, exist_ok=True)
        path = self._generate_file_name()
        logger.info("writing FDO stats to %s", path)
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(_COLUMNS)
            for name in sorted(self._observed_max_ids):
                writer.writerow([name, self._observed_max_ids[name], self._observed_max_unique_ids[name],
                                 self._dropped_counts[name]])

    def load(self) -> KeyedSparseCoreInputStats:
        pattern = f"{self._FILE_NAME}*.{self._FILE_EXTENSION}"
        files = self._get_latest_files_by_process([str(p) for p in self._base_dir.glob(pattern)])
        if not files:
            raise FileNotFoundError(f"no FDO stats files {pattern} in {self._base_dir}")
        merged: dict[str, SparseCoreInputStats] = {}
        for path in files:
            with open(path, newline="") as f:
                for row in csv.DictReader(f):
                    stats = merged.setdefault(row["table_name"], SparseCoreInputStats())
                    stats.observed_max_ids = max(stats.observed_max_ids, int(row["max_ids"]))
                    stats.observed_max_unique_ids = max(stats.observed_max_unique_ids, int(row["max_unique_ids"]))
                    stats.dropped_count += int(row["dropped_count"])
        return KeyedSparseCoreInputStats(merged)
