"""An ``infer`` rerun redoes the parts whose input file was rewritten since they were written (same
row-group layout included), and says so; unchanged inputs are not redone. The bookkeeping on real
files here; the end-to-end rerun (Ray) in ``test_infer_faults.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.schema import CRITEO
from torchrec_tpu.inference.units import claim_output_dir, pending_units, plan_units, write_part

COLUMNS = [*CRITEO.dense, *CRITEO.sparse]


def _predicted(tiny_copy: Path, out: Path):
    units = plan_units(tiny_copy, COLUMNS)
    claim_output_dir(out, units, tiny_copy)
    for unit in units:
        write_part(out, unit, pa.table({"prediction": pa.array([0.5] * unit.num_rows, pa.float32())}))
    return units


def _rewrite_same_layout(path: Path, keep_mtime: bool) -> None:
    """The file's rows with one dense column changed, in the same row groups."""
    stat = path.stat()
    table = pq.read_table(path)
    index = table.schema.get_field_index("I1")
    table = table.set_column(index, "I1", pc.add(table.column("I1"), 1))
    pq.write_table(table, path, row_group_size=pq.ParquetFile(path).metadata.row_group(0).num_rows)
    if keep_mtime:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_rewritten_input_redoes_its_parts_only(tiny_copy, tmp_path):
    out = tmp_path / "out"
    units = _predicted(tiny_copy, out)
    assert pending_units(out, units) == ([], [])
    rewritten = tiny_copy / "part-00001.parquet"
    _rewrite_same_layout(rewritten, keep_mtime=True)  # the footer hash tells, not the mtime
    replanned = plan_units(tiny_copy, COLUMNS)
    claim_output_dir(out, replanned, tiny_copy)  # same layout: the same job
    todo, changed = pending_units(out, replanned)
    assert todo == changed and {u.path for u in changed} == {str(rewritten.resolve())}
    assert len(changed) == 2  # its two row groups


def test_touched_input_is_redone_and_a_missing_part_run(tiny_copy, tmp_path):
    out = tmp_path / "out"
    units = _predicted(tiny_copy, out)
    os.utime(tiny_copy / "part-00002.parquet")  # a newer mtime: the rows may have changed
    (out / units[0].part_name).unlink()
    todo, changed = pending_units(out, plan_units(tiny_copy, COLUMNS))
    assert [u.ordinal for u in changed] == [4, 5]  # part-00002's two row groups
    assert [u.ordinal for u in todo] == [0, 4, 5]
