"""A job whose embedding tables and optimizer state cannot fit this host's memory is refused
before any model is built, in one line naming the largest tables, the bytes, the memory and what
to change, with no run directory left; the bytes are hand-computed from the tables' shapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchrec_tpu.cli import main
from torchrec_tpu.train.config import ConfigError
from torchrec_tpu.train.memory_preflight import available_host_bytes, check_table_memory, table_bytes


@pytest.mark.parametrize("optimizer, per_row", [("sgd", 4 * 16), ("adagrad", 2 * 4 * 16),
                                                ("rowwise_adagrad", 4 * 16 + 4)])
def test_a_tables_bytes_are_its_fp32_rows_and_the_optimizers_slots(optimizer, per_row):
    assert table_bytes(1000, 16, optimizer) == 1000 * per_row


def test_a_table_beyond_int32_rows_is_counted_and_refused_for_its_bytes():
    assert table_bytes(10**12, 16, "rowwise_adagrad") == 10**12 * (4 * 16 + 4)
    with pytest.raises(ConfigError, match=r"largest: item 1,000,000,000,000 rows \(68,000.0 GB\).*; remap the ids$"):
        check_table_memory(["item"], [10**12], 16, "rowwise_adagrad", 1, 1, available=2**40, remedy="remap the ids")


def test_tables_over_the_available_memory_are_refused_naming_the_largest():
    names, rows = ["small", "big", "mid", "tiny"], [10, 3_000_000, 1_000_000, 1]
    need = sum(r * 2 * 4 * 32 for r in rows)  # adagrad: the weight and its accumulator, fp32
    check_table_memory(names, rows, 32, "adagrad", 1, 1, available=need)  # fits exactly
    with pytest.raises(ConfigError) as refused:
        check_table_memory(names, rows, 32, "adagrad", 1, 1, available=need - 1)
    line = str(refused.value)
    assert line.startswith(f"the embedding tables need {need / 1e9:,.1f} GB of this host's memory (4 tables x 32 "
                           "fp32 with adagrad state"), line
    assert "largest: big 3,000,000 rows (0.8 GB), mid 1,000,000 rows (0.3 GB), small 10 rows" in line, line
    assert "lower --num-embeddings or --num-embeddings-per-feature" in line and "\n" not in line


def test_ranks_on_other_hosts_take_their_share():
    rows = [1_000_000] * 4
    need = sum(table_bytes(r, 16, "sgd") for r in rows)
    check_table_memory(list("abcd"), rows, 16, "sgd", 4, 1, available=need // 4)  # 1 of 4 ranks here
    with pytest.raises(ConfigError, match=r"2 of 4 ranks on this host"):
        check_table_memory(list("abcd"), rows, 16, "sgd", 4, 2, available=need // 4)
    check_table_memory(list("abcd"), rows, 16, "sgd", 1, 1, available=None)  # the system does not say: no check


def test_available_memory_is_read_from_meminfo(tmp_path: Path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:  1000 kB\nMemAvailable:   22000000 kB\n")
    assert available_host_bytes(meminfo) == 22_000_000 * 1024
    meminfo.write_text("MemTotal:       24576000 kB\n")
    assert available_host_bytes(meminfo) is None
    assert available_host_bytes(Path("/proc/meminfo")) > 0


def test_train_refuses_40m_row_tables_before_building_and_leaves_no_run_directory(tmp_path, capsys):
    sizes = ",".join(["40000000"] * 26)
    rc = main(["train", "--data", "sample", "--num-embeddings-per-feature", sizes, "--embedding-dim", "128",
               "--dense-arch", "64,128", "--log-dir", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2, err
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert "the embedding tables need 1,065.0 GB of this host's memory (26 tables x 128" in line, line
    assert "C1 40,000,000 rows (41.0 GB)" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("policy, per_slot", [("lfu", 8 + 8 + 8), ("lru", 8 + 8 + 8), ("distance_lfu", 8 + 8 + 16)])
def test_a_zch_tables_remap_is_counted_per_slot(policy, per_slot):
    """The remap's identity table (raw id, slot: int64 each) and the policy's metadata per slot
    (LFU: counts; LRU: last access; distance-LFU: both), as the remap holds them."""
    from torchrec_tpu.sharding.zch import TableRemap, ZchSpec

    remap = TableRemap(1000, ZchSpec(policy))
    held = sum(t.nbytes for t in (remap.sorted_ids, remap.slot_of, *remap.metadata.values()))
    assert held == 1000 * per_slot
    assert table_bytes(1000, 16, "sgd", zch_policy=policy) == 1000 * (4 * 16 + per_slot)
    need = table_bytes(1000, 16, "sgd", zch_policy=policy) + table_bytes(500, 16, "sgd")
    check_table_memory(["item", "user"], [1000, 500], 16, "sgd", 1, 1, available=need, zch={"item": policy})
    with pytest.raises(ConfigError, match=r"largest: item 1,000 rows"):
        check_table_memory(["item", "user"], [1000, 500], 16, "sgd", 1, 1, available=need - 1, zch={"item": policy})
