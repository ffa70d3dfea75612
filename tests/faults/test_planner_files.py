"""Topology and tables files with ordinary mistakes: one ``error:`` line naming the file, the key,
the bad value and what is expected; numbers YAML reads as strings (``1e12``) are taken as numbers."""

from __future__ import annotations

import pytest

from tests.faults.helpers import assert_clean_error
from torchrec_tpu.cli import main

TABLES = "- {name: t0, rows: 1000, dim: 16}\n"


def _plan(capsys, tmp_path, topology: str, tables: str = TABLES) -> tuple[int, str, str]:
    (tmp_path / "topo.yaml").write_text(topology)
    (tmp_path / "tables.yaml").write_text(tables)
    rc = main(["plan", "--tables", str(tmp_path / "tables.yaml"), "--topology", str(tmp_path / "topo.yaml"),
               "--out", str(tmp_path / "plan.json")])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.parametrize("topology, fragments", [
    ("chip:\n  ici_bandwidth_bytes_per_s: 0\n", ["chip.ici_bandwidth_bytes_per_s", "expected a number > 0", "got 0"]),
    ("chip:\n  hbm_bandwidth_bytes_per_s: fast\n", ["chip.hbm_bandwidth_bytes_per_s", "expected a number > 0",
                                                    "'fast'"]),
    ("costs:\n  kernel_overhead_s: .nan\n", ["costs.kernel_overhead_s", "expected a number >= 0", "nan"]),
    ("costs:\n  collective_latency_s: .inf\n", ["costs.collective_latency_s", "inf"]),
    ("costs:\n  hbm_reserved_fraction: 1.5\n", ["costs", "hbm_reserved_fraction", "1.5"]),
    ("num_slices: two\n", ["num_slices", "expected a whole number > 0", "'two'"]),
    ("chip: [1, 2]\n", ["chip", "expected a mapping", "[1, 2]"]),
    ("chip:\n  name_counts_tensorcores: 1\n", ["chip.name_counts_tensorcores", "expected true or false"]),
])
def test_bad_topology_values_name_file_and_key(capsys, tmp_path, topology, fragments):
    rc, _, err = _plan(capsys, tmp_path, "slice: v5p-8\n" + topology)
    assert_clean_error(rc, err, str(tmp_path / "topo.yaml"), *fragments)


def test_exponent_numbers_yaml_reads_as_strings_are_numbers(capsys, tmp_path):
    rc, out, err = _plan(capsys, tmp_path, "slice: v5p-8\nnum_slices: 2\nchip:\n  ici_bandwidth_bytes_per_s: 1e12\n"
                                           "  dcn_bandwidth_bytes_per_s: 5e9\n  hbm_gib: 1e2\n",
                         "- {name: t0, rows: 1e6, dim: 16}\n")
    assert rc == 0, err
    assert "wrote plan" in out


@pytest.mark.parametrize("tables, fragments", [
    ("- t0\n- t1\n", ["entry 0", "expected a mapping of table fields", "'t0'"]),
    ("tables:\n- {name: t0, rows: 1000, dim: '16.5'}\n", ["entry 0 ('t0')", "dim", "expected a whole number > 0",
                                                          "'16.5'"]),
    ("- {name: t0, rows: 1000, dim: 16, pooling_factor: .nan}\n", ["entry 0 ('t0')", "pooling_factor", "nan"]),
    ("- {name: t0, rows: 0, dim: 16}\n", ["entry 0 ('t0')", "rows", "got 0"]),
])
def test_bad_tables_entries_name_file_entry_and_key(capsys, tmp_path, tables, fragments):
    rc, _, err = _plan(capsys, tmp_path, "slice: v5p-8\n", tables)
    assert_clean_error(rc, err, str(tmp_path / "tables.yaml"), *fragments)
