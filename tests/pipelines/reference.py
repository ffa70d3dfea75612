"""Plain-Python reference parsing of Criteo text rows (csv module, int(), int(x, 16))."""

from __future__ import annotations

import csv
from pathlib import Path

from pipelines.schema import CRITEO


def parse_reference_row(fields: list[str]) -> dict[str, int | None]:
    """One text row as the Parquet layout should hold it."""
    assert len(fields) == len(CRITEO.column_names)
    row: dict[str, int | None] = {CRITEO.label: int(fields[0])}
    for name, text in zip(CRITEO.dense, fields[1:14]):
        row[name] = int(float(text)) if text else None
    for name, text in zip(CRITEO.sparse, fields[14:]):
        row[name] = int(text, 16) if text else None
    return row


def reference_rows(path: Path, delimiter: str = ",", header: bool = True) -> list[dict[str, int | None]]:
    with open(path, newline="") as f:
        lines = list(csv.reader(f, delimiter=delimiter))
    return [parse_reference_row(fields) for fields in (lines[1:] if header else lines)]


def write_tsv(rows: list[list[str]], path: Path) -> Path:
    path.write_text("".join("\t".join(fields) + "\n" for fields in rows))
    return path


def sample_fields(path: Path) -> list[list[str]]:
    """The sample's data rows as lists of text fields (header dropped)."""
    with open(path, newline="") as f:
        return list(csv.reader(f))[1:]
