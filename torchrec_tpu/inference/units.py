"""Work units of an inference job and their exactly-once bookkeeping in the output directory.

A unit is one input row group. Unit i writes ``part-<i>.parquet`` by writing a temporary file and
renaming it, so a part either exists complete or not at all. A rerun over the same inputs skips
the parts that exist; ``_inputs.json`` (written first) pins the unit list, so a rerun with other
inputs into the same directory is refused instead of mixing two jobs.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.parquet_reader import check_column_types, list_parquet_files, open_parquet
from pipelines.schema import CRITEO, DatasetSchema

MANIFEST = "_inputs.json"
TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class Unit:
    ordinal: int
    path: str
    row_group: int
    first_row: int  # global row index (over all inputs, in order) of the group's first row
    num_rows: int

    @property
    def part_name(self) -> str:
        return f"part-{self.ordinal:06d}.parquet"


def plan_units(paths: str | Path | Sequence[str | Path], required_columns: Sequence[str],
               schema: DatasetSchema = CRITEO) -> list[Unit]:
    """One unit per row group of the inputs, in file order; every file must hold the columns,
    ``schema``'s dense and categorical ones of usable types."""
    units: list[Unit] = []
    first_row = 0
    for path in list_parquet_files(paths):
        parquet_file = open_parquet(path)
        missing = [c for c in required_columns if c not in parquet_file.schema_arrow.names]
        if missing:
            raise ValueError(f"{path}: inference needs columns {missing}, which are missing")
        check_column_types(path, parquet_file.schema_arrow, schema, label=False)
        for index in range(parquet_file.metadata.num_row_groups):
            rows = parquet_file.metadata.row_group(index).num_rows
            units.append(Unit(len(units), str(path.resolve()), index, first_row, rows))
            first_row += rows
    return units


def claim_output_dir(output_dir: Path, units: list[Unit], checkpoint: Path) -> None:
    """Create ``output_dir`` for these units, or check that it already belongs to them."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"--output={str(output_dir)!r} is a file; give a directory (created if missing)")
    output_dir.mkdir(parents=True, exist_ok=True)
    manifest = {"checkpoint": str(checkpoint.resolve()), "units": [asdict(u) for u in units]}
    path = output_dir / MANIFEST
    if path.is_file():
        previous = json.loads(path.read_text())
        if previous != manifest:
            raise ValueError(
                f"{output_dir} holds the output of another job (different inputs or checkpoint, "
                f"see {path}); choose an empty output directory"
            )
    else:
        write_atomically(path, lambda tmp: tmp.write_text(json.dumps(manifest, indent=1)))
    for stale in output_dir.glob(f"{TMP_PREFIX}*"):  # left by a killed run
        stale.unlink()


def pending_units(output_dir: Path, units: list[Unit]) -> list[Unit]:
    return [u for u in units if not (output_dir / u.part_name).is_file()]


def write_atomically(path: Path, write) -> None:  # write: Callable[[Path], object]
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def write_part(output_dir: Path, unit: Unit, table: pa.Table) -> Path:
    path = output_dir / unit.part_name
    write_atomically(path, lambda tmp: pq.write_table(table, tmp))
    return path
