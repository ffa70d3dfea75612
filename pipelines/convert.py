"""Text logs (TSV / CSV) to Parquet: streaming, bounded memory, every row accounted for."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from pipelines.dataset_dir import staged_dataset
from pipelines.parquet_writer import ParquetShardWriter, written_rows
from pipelines.progress import ProgressLine, progress_bar
from pipelines.schema import CRITEO, DatasetSchema
from pipelines.text_blocks import DEFAULT_MAX_LINE_BYTES
from pipelines.text_reader import BadRow, BadRowPolicy, TextFormat, TextReader

_log = logging.getLogger(__name__)


@dataclass
class ConversionReport:
    """What a conversion read, wrote and skipped; ``rows_read == rows_written + rows_skipped``."""

    files: list[Path]
    rows_read: int = 0
    rows_written: int = 0
    rows_skipped: int = 0
    bad_rows: list[BadRow] = field(default_factory=list)  # the first few of each input

    def summary(self) -> str:
        return (
            f"read {self.rows_read:,} rows, wrote {self.rows_written:,} to {len(self.files)} "
            f"Parquet files, skipped {self.rows_skipped:,} malformed rows"
        )


def convert_to_parquet(
    inputs: Sequence[str | Path],
    output_dir: str | Path,
    schema: DatasetSchema = CRITEO,
    text_format: TextFormat | None = None,
    on_bad_row: BadRowPolicy = "error",
    rows_per_file: int = 1 << 22,
    row_group_size: int = 1 << 17,
    block_size: int = 1 << 22,
    progress: bool = True,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> ConversionReport:
    """Converts text logs into Parquet files under ``output_dir`` (absent or empty), published
    atomically with a completion marker (:mod:`pipelines.dataset_dir`): a failed or killed run
    leaves no dataset there.

    ``text_format`` defaults to detection by file name (``*.csv`` has a header, anything else is
    headerless TSV). Raises :class:`pipelines.text_reader.BadRowError` on the first malformed row
    unless ``on_bad_row="skip"``; then such rows are counted in the report, and
    :class:`pipelines.text_blocks.LineTooLongError` on a line longer than ``max_line_bytes``.
    """
    paths = [Path(p) for p in inputs]
    if not paths:
        raise ValueError("no input files given")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"input files not found: {missing}")
    report = ConversionReport(files=[])
    total_bytes = sum(p.stat().st_size for p in paths)
    with staged_dataset(output_dir) as staged:
        with progress_bar(
            total=total_bytes, unit="B", unit_scale=True, desc="convert", enabled=progress
        ) as bar, ParquetShardWriter(
            staged.path, schema.arrow_schema(), rows_per_file, row_group_size
        ) as writer:
            # no bar (not a terminal): a start line, then a progress line now and then
            lines = ProgressLine(_log.info, "convert") if progress and bar.disable else None
            if lines is not None:
                _log.info("convert: reading %d file(s), %s bytes, into %s", len(paths), f"{total_bytes:,}", output_dir)
            read_bytes = 0

            def consumed(count: int) -> None:
                nonlocal read_bytes
                read_bytes += count
                bar.update(count)

            for path in paths:
                reader = TextReader(path, schema, text_format, on_bad_row, block_size, consumed, max_line_bytes)
                for batch in reader:
                    writer.write(batch)
                    if lines is not None:
                        lines.update(report.rows_read + reader.stats.rows_read, read_bytes / max(total_bytes, 1))
                report.rows_read += reader.stats.rows_read
                report.rows_skipped += reader.stats.rows_skipped
                report.bad_rows += reader.stats.bad_rows
                bar.set_postfix(rows=report.rows_read, skipped=report.rows_skipped)
        report.rows_written = written_rows(writer.files)
        if report.rows_read != report.rows_written + report.rows_skipped:
            raise RuntimeError(f"row accounting broke: {report.summary()}")
    report.files = staged.files
    return report
