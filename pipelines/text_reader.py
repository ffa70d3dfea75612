"""Streaming readers for Criteo-style text logs: headerless TSV (Criteo 1TB / Kaggle) and CSV with
a header line. They yield Arrow record batches in the Parquet layout of ``pipelines.schema``.

Malformed rows (wrong column count, a non-integer dense field, a non-hex categorical, a missing or
non-0/1 label, bytes that are not UTF-8) either raise :class:`BadRowError` naming ``file:line`` and
the column (``on_bad_row="error"``) or are counted and skipped (``on_bad_row="skip"``). Columns are
never shifted to make a row fit. A file that cannot be read at all (empty, a truncated or corrupt
compressed stream) raises :class:`UnreadableInputError` naming it, whatever the policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Literal

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from pipelines.schema import CRITEO, DatasetSchema
from pipelines.text_blocks import COMPRESSION_BY_SUFFIX, DEFAULT_MAX_LINE_BYTES, LineBlock, line_blocks
from pipelines.text_parsing import parse_binary_label, parse_hex, parse_int

BadRowPolicy = Literal["error", "skip"]
BAD_ROW_POLICIES: tuple[str, ...] = ("error", "skip")
MAX_REPORTED_BAD_ROWS = 20
_REPLACEMENT = "\ufffd"  # what undecodable bytes read as (pipelines.text_blocks)


@dataclass(frozen=True)
class TextFormat:
    """Field delimiter and whether the first line names the columns."""

    delimiter: str
    header: bool


TSV = TextFormat(delimiter="\t", header=False)
CSV = TextFormat(delimiter=",", header=True)


def detect_format(path: str | Path) -> TextFormat:
    """CSV (with header) for ``*.csv[.gz]``, headerless TSV otherwise (the Criteo release layout)."""
    suffixes = [s for s in Path(path).suffixes if s not in COMPRESSION_BY_SUFFIX]
    return CSV if suffixes and suffixes[-1] == ".csv" else TSV


@dataclass(frozen=True)
class BadRow:
    """One malformed input row: where it is and what is wrong with it."""

    path: str
    line: int | None
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line if self.line is not None else '?'}: {self.reason}"


class UnreadableInputError(ValueError):
    """An input file cannot be parsed at all (empty, truncated or corrupt compression)."""


class BadRowError(ValueError):
    """A malformed row under ``on_bad_row="error"``."""

    def __init__(self, bad_row: BadRow) -> None:
        super().__init__(f"{bad_row} (--on-bad-row skip counts and skips such rows)")
        self.bad_row = bad_row


@dataclass
class ReadStats:
    """Row accounting of one reader: ``rows_read == rows_accepted + rows_skipped``."""

    rows_read: int = 0
    rows_accepted: int = 0
    rows_skipped: int = 0
    bad_rows: list[BadRow] = field(default_factory=list)  # the first MAX_REPORTED_BAD_ROWS

    @property
    def wants_reports(self) -> bool:
        return len(self.bad_rows) < MAX_REPORTED_BAD_ROWS


class TextReader:
    """Iterates one text file as Arrow record batches of ``schema.arrow_schema()``.

    ``on_progress(n)`` is called with the number of (compressed) input bytes consumed since the
    last call; ``stats`` holds the row accounting once iteration ends.
    """

    def __init__(
        self,
        path: str | Path,
        schema: DatasetSchema = CRITEO,
        text_format: TextFormat | None = None,
        on_bad_row: BadRowPolicy = "error",
        block_size: int = 1 << 22,
        on_progress: Callable[[int], None] | None = None,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    ) -> None:
        if on_bad_row not in BAD_ROW_POLICIES:
            raise ValueError(f"on_bad_row must be one of {BAD_ROW_POLICIES}, got {on_bad_row!r}")
        if schema.multi_hot:
            raise ValueError(
                f"text logs hold single-hot categoricals; {sorted(schema.multi_hot)} are multi-hot"
            )
        self.path = Path(path)
        self.schema = schema
        self.text_format = text_format or detect_format(path)
        self.on_bad_row = on_bad_row
        self.block_size = block_size
        self.max_line_bytes = max_line_bytes
        self.on_progress = on_progress
        self.stats = ReadStats()
        self._output_schema = schema.arrow_schema()
        self._skipped_lines: list[int] = []  # physical lines of rows the CSV parser dropped
        self._line_offset = 0  # lines before the block being parsed
        self._pending_error: BadRowError | None = None

    @property
    def _first_data_line(self) -> int:
        return 2 if self.text_format.header else 1

    def _on_invalid_row(self, row: pacsv.InvalidRow) -> str:
        line = self._line_offset + row.number
        bad = BadRow(
            str(self.path),
            line,
            f"expected {row.expected_columns} columns, got {row.actual_columns}",
        )
        self.stats.rows_read += 1
        if self.on_bad_row == "error":
            self._pending_error = self._pending_error or BadRowError(bad)
        else:
            self.stats.rows_skipped += 1
        if self.on_bad_row == "error" or self.stats.wants_reports:
            self._skipped_lines.append(line)
            if self.on_bad_row == "skip":
                self.stats.bad_rows.append(bad)
        return "skip"

    def _line_of(self, accepted_index: int) -> int:
        """Physical line of the ``accepted_index``-th row that passed the column-count check."""
        line = self._first_data_line + accepted_index
        for skipped in self._skipped_lines:  # ascending: the parser runs single-threaded
            if skipped > line:
                break
            line += 1
        return line

    def _parse(self, block: LineBlock) -> pa.Table:
        """One block of whole lines as a table of string columns (single-threaded, so the parser
        reports bad rows in order)."""
        self._line_offset = block.first_line - 1
        names = self.schema.column_names
        with_header = self.text_format.header and block.first_line == 1
        table = pacsv.read_csv(
            pa.BufferReader(block.data),
            read_options=pacsv.ReadOptions(
                use_threads=False,
                block_size=len(block.data) + 1,
                column_names=None if with_header else names,
            ),
            parse_options=pacsv.ParseOptions(
                delimiter=self.text_format.delimiter,
                quote_char=False,
                # A blank line becomes a row without a label, which is then reported, not dropped.
                ignore_empty_lines=False,
                invalid_row_handler=self._on_invalid_row,
            ),
            convert_options=pacsv.ConvertOptions(
                column_types={name: pa.string() for name in names},
                strings_can_be_null=True,
                null_values=[""],
            ),
        )
        if with_header and table.schema.names != names:
            header = table.schema.names
            shown = repr(header) if len(repr(header)) <= 200 else f"{repr(header)[:200]}... ({len(header)} columns)"
            raise ValueError(f"{self.path}:1: header {shown} does not match the schema columns {names}")
        return table

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        self.stats = ReadStats()
        self._skipped_lines = []
        self._pending_error = None
        try:
            yield from self._batches()
        except (pa.ArrowInvalid, OSError, EOFError) as error:  # not BadRowError: it is no ArrowInvalid
            raise UnreadableInputError(f"{self.path}: cannot read it as {self._format_name}: {error}") from None

    @property
    def _format_name(self) -> str:
        compression = COMPRESSION_BY_SUFFIX.get(self.path.suffix)
        kind = "CSV" if self.text_format.header else "TSV"
        return f"{compression}-compressed {kind}" if compression else kind

    def _batches(self) -> Iterator[pa.RecordBatch]:
        accepted_before = 0
        empty = True
        for block in line_blocks(self.path, self.block_size, self.max_line_bytes, self.on_progress):
            empty = False
            for text_batch in self._parse(block).to_batches():
                try:
                    batch = self._convert(text_batch, accepted_before)
                except BadRowError as error:
                    raise self._earliest(error) from None
                if self._pending_error is not None:
                    raise self._pending_error
                accepted_before += text_batch.num_rows
                if batch.num_rows:
                    yield batch
            if self._pending_error is not None:
                raise self._pending_error
        if empty:
            raise EOFError("empty file")
        self.stats.bad_rows.sort(key=lambda bad: bad.line or 0)

    def _earliest(self, error: BadRowError) -> BadRowError:
        """The earlier of a conversion error and a pending column-count error of the same block."""
        pending = self._pending_error
        if pending is not None and (pending.bad_row.line or 0) < (error.bad_row.line or 0):
            return pending
        return error

    def _convert(self, text_batch: pa.RecordBatch, accepted_before: int) -> pa.RecordBatch:
        columns: list[pa.Array] = []
        malformed_by_column: list[tuple[str, np.ndarray]] = []
        parsers = [(self.schema.label, parse_binary_label)]
        parsers += [(name, parse_int) for name in self.schema.dense]
        parsers += [(name, parse_hex) for name in self.schema.sparse]
        for name, parser in parsers:
            parsed, malformed = parser(text_batch.column(name))
            columns.append(parsed)
            malformed_by_column.append((name, malformed))
        self.stats.rows_read += text_batch.num_rows
        any_malformed = np.logical_or.reduce([m for _, m in malformed_by_column])
        batch = pa.RecordBatch.from_arrays(columns, schema=self._output_schema)
        if any_malformed.any():
            bad_rows = np.flatnonzero(any_malformed)
            if self.on_bad_row == "error":
                raise BadRowError(
                    self._describe(text_batch, malformed_by_column, int(bad_rows[0]), accepted_before)
                )
            for row in bad_rows[: MAX_REPORTED_BAD_ROWS - len(self.stats.bad_rows)]:
                self.stats.bad_rows.append(
                    self._describe(text_batch, malformed_by_column, int(row), accepted_before)
                )
            self.stats.rows_skipped += len(bad_rows)
            batch = batch.filter(pa.array(~any_malformed))
        self.stats.rows_accepted += batch.num_rows
        return batch

    def _describe(
        self,
        text_batch: pa.RecordBatch,
        malformed_by_column: list[tuple[str, np.ndarray]],
        row: int,
        accepted_before: int,
    ) -> BadRow:
        name = next(name for name, malformed in malformed_by_column if malformed[row])
        value = text_batch.column(name)[row].as_py()
        if isinstance(value, str) and _REPLACEMENT in value:
            reason = f"column {name}: not valid UTF-8 (undecodable bytes shown as U+FFFD): {value!r}"
            return BadRow(str(self.path), self._line_of(accepted_before + row), reason)
        if name == self.schema.label:
            expected = "a 0/1 label"
        elif name in self.schema.dense:
            expected = "an integer"
        else:
            expected = "a hex id of at most 16 digits below 2^63"
        reason = f"column {name}: expected {expected}, got {value!r}"
        return BadRow(str(self.path), self._line_of(accepted_before + row), reason)
