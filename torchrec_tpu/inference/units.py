"""Work units of an inference job and their exactly-once bookkeeping in the output directory.

A unit is one input row group. Unit i writes ``part-<i>.parquet`` by writing a temporary file and
renaming it, so a part either exists complete or not at all. Each part records the identity of its
input file (:mod:`torchrec_tpu.inference.input_identity`); a rerun over the same inputs skips the
parts that exist and redoes those whose input changed since. ``_inputs.json`` (written first) pins
the unit list, so a rerun with other inputs into the same directory is refused instead of mixing
two jobs.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import pyarrow as pa

from pipelines.parquet_checksums import note_unverifiable
from pipelines.parquet_files import check_column_types, list_parquet_files, open_parquet
from pipelines.parquet_writer import write_table
from pipelines.schema import CRITEO, DatasetSchema
from torchrec_tpu.inference.input_identity import METADATA_KEY, input_identity, recorded_identity

MANIFEST = "_inputs.json"
TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class Unit:
    ordinal: int
    path: str
    row_group: int
    first_row: int  # global row index (over all inputs, in order) of the group's first row
    num_rows: int
    input_id: str = ""  # identity of the input file when planned, recorded in the part

    @property
    def part_name(self) -> str:
        return f"part-{self.ordinal:06d}.parquet"


def plan_units(paths: str | Path | Sequence[str | Path], required_columns: Sequence[str],
               schema: DatasetSchema | None = CRITEO) -> list[Unit]:
    """One unit per row group of the inputs, in file order; every file must hold the columns,
    ``schema``'s dense and categorical ones of usable types (None: HSTU's sequence rows, whose list
    columns the reader checks)."""
    units: list[Unit] = []
    first_row = 0
    files = list_parquet_files(paths)
    note_unverifiable(files)
    for path in files:
        parquet_file = open_parquet(path)
        missing = [c for c in required_columns if c not in parquet_file.schema_arrow.names]
        if missing:
            raise ValueError(f"{path}: inference needs columns {missing}, which are missing")
        if schema is not None:
            check_column_types(path, parquet_file.schema_arrow, schema, label=False)
        input_id = input_identity(path)
        for index in range(parquet_file.metadata.num_row_groups):
            rows = parquet_file.metadata.row_group(index).num_rows
            units.append(Unit(len(units), str(path.resolve()), index, first_row, rows, input_id))
            first_row += rows
    return units


def claim_output_dir(output_dir: Path, units: list[Unit], checkpoint: Path) -> None:
    """Create ``output_dir`` for these units, or check that it already belongs to them."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"--output={str(output_dir)!r} is a file; give a directory (created if missing)")
    output_dir.mkdir(parents=True, exist_ok=True)
    layout = [{k: v for k, v in asdict(u).items() if k != "input_id"} for u in units]
    manifest = {"checkpoint": str(checkpoint.resolve()), "units": layout}
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


def pending_units(output_dir: Path, units: list[Unit]) -> tuple[list[Unit], list[Unit]]:
    """(the units to run, those of them whose part exists but was predicted from an input that
    has changed since: another size, mtime or footer)."""
    todo, changed = [], []
    for unit in units:
        part = output_dir / unit.part_name
        if not part.is_file():
            todo.append(unit)
        elif recorded_identity(part) != unit.input_id:
            todo.append(unit)
            changed.append(unit)
    return todo, changed


def write_atomically(path: Path, write) -> None:  # write: Callable[[Path], object]
    """``write(tmp)`` then rename onto ``path``; a failed write (a full disk) leaves no temporary
    file and raises an OSError naming ``path`` and the space left there."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as error:
        free = shutil.disk_usage(path.parent).free  # at the failure, before the cleanup frees some
        tmp.unlink(missing_ok=True)
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise OSError(error.errno, f"cannot write {path}: {reason} ({free} bytes free in {path.parent})") from None


def write_part(output_dir: Path, unit: Unit, table: pa.Table) -> Path:
    path = output_dir / unit.part_name
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), METADATA_KEY: unit.input_id})
    write_atomically(path, lambda tmp: write_table(table, tmp))
    return path
