"""Storage and time of each sharding, written out by hand for a 4-chip v5p-8 (D=4, S=4, N=16)."""

import pytest

from sparsecore import FTRL, SGD, Adagrad, Adam, RowWiseAdagrad, TableSpec
from torchrec_tpu.planner.cost_model import OptionBuilder, row_bytes
from torchrec_tpu.planner.tables import EmbeddingTable, tables_from_sparsecore_specs
from torchrec_tpu.topology import parse_accelerator_type
from tpu_facts import ShardingKind

TOPO = parse_accelerator_type("v5p-8")
BW_SC = 2765e9 * 0.5  # HBM bandwidth x default SparseCore efficiency
ICI = 600e9  # one direction, per chip
# 1000 rows, dim 12 -> padded 16; Adagrad: one slot per element -> 4 * 16 * 2 = 128 B per row
TABLE = EmbeddingTable("t", rows=1000, dim=12, pooling_factor=2.0, optimizer="adagrad")
BATCH = 64  # local batch 16, 32 ids per device per step


@pytest.fixture
def builder():
    return OptionBuilder(TOPO, BATCH)


def test_row_wise_by_hand(builder):
    o = builder.row_wise(TABLE)
    # rows padded to 8 * 16 SparseCores = 128 -> 1024, 256 per device
    assert o.rows_per_device == 256
    assert o.uniform.hbm_bytes == 256 * 128
    assert o.uniform.lookup_s == pytest.approx(32 * (4 * 16 + 2 * 128) / BW_SC)
    # ids 12 B each + 2 partial sums per sample (P=2 < N) forward and backward, 3/4 leave the device
    sent = 0.75 * (12 * 32 + 2 * 16 * 2 * 4 * 16)
    assert sent == 3360
    hops = 0.5 + 0.5 + 0.0  # 2x2x1 mesh
    assert o.uniform.comm_s == pytest.approx(sent * hops / ICI)
    assert o.uniform.buffer_bytes == pytest.approx(sent + 2 * 16 * 4 * 16)
    assert o.ids_per_partition == pytest.approx(16 / 4 * 2 / 16)
    assert o.shards == ()


def test_table_wise_by_hand(builder):
    o = builder.column_wise(TABLE, 1)
    assert o.kind is ShardingKind.TABLE_WISE
    (shard,) = o.shards
    assert shard.rows == 1024  # padded to 8 * 4 SparseCores of one device
    assert shard.load.hbm_bytes == 1024 * 128
    assert shard.load.lookup_s == pytest.approx(128 * (4 * 16 + 2 * 128) / BW_SC)  # all 128 ids
    owner_bytes = 3 * (12 * 32 + 16 * 4 * 16)
    assert shard.load.comm_s == pytest.approx(owner_bytes / ICI)
    assert o.ids_per_partition == pytest.approx(16 / 4 * 2 / 4)


def test_column_wise_and_data_parallel_by_hand(builder):
    cw = builder.column_wise(TABLE, 2)
    assert [(s.column_offset, s.columns) for s in cw.shards] == [(0, 8), (8, 8)]
    assert all(s.load.hbm_bytes == 1024 * 4 * 8 * 2 for s in cw.shards)
    # data-parallel as the runtime runs it: a replica per device (rows padded to 8 * 4 SparseCores),
    # each looking up and updating all 128 ids; ids to the 3 other replicas, their pooled rows and
    # gradients back (16 samples x 1 feature x 4 B x 16): no all-reduce
    dp = builder.data_parallel(TABLE)
    assert dp.uniform.hbm_bytes == 1024 * 128
    assert dp.uniform.lookup_s == pytest.approx(128 * (4 * 16 + 2 * 128) / BW_SC)
    sent = 3 * (12 * 32 + 2 * 16 * 4 * 16)
    assert dp.uniform.comm_s == pytest.approx(sent * (0.5 + 0.5) / ICI)
    assert dp.uniform.buffer_bytes == pytest.approx(sent + 2 * 16 * 4 * 16)
    assert dp.ids_per_partition == pytest.approx(16 / 4 * 2 / 4)  # as table-wise: S destinations


def test_optimizer_slots_change_memory():
    b = OptionBuilder(TOPO, BATCH)
    rows = {opt: b.row_wise(EmbeddingTable("t", 1024, 16, optimizer=opt)).uniform.hbm_bytes
            for opt in ("sgd", "rowwise_adagrad", "adagrad", "adam")}
    per_row = {"sgd": 64, "rowwise_adagrad": 68, "adagrad": 128, "adam": 192}
    assert rows == {k: 256 * v for k, v in per_row.items()}


@pytest.mark.parametrize("dim, counts", [(8, []), (12, [2]), (17, []), (40, []), (128, [2, 4])])
def test_column_split_counts(dim, counts):
    assert OptionBuilder(TOPO, BATCH).column_split_counts(EmbeddingTable("t", 10, dim)) == counts


def test_bad_batch():
    with pytest.raises(ValueError, match="divide evenly over 4 devices"):
        OptionBuilder(TOPO, 66)


@pytest.mark.parametrize(("spec", "bytes_per_row"), [
    (SGD(0.1), 4 * 8),  # the weights only
    (Adagrad(0.1), 4 * 8 * 2),  # + one accumulator per element
    (RowWiseAdagrad(0.1), 4 * 8 + 4),  # + one accumulator per row
    (Adam(0.1), 4 * 8 * 3),  # + momentum and velocity per element
    (FTRL(0.1), 4 * 8 * 3),  # + accumulator and linear per element
])
def test_planner_prices_the_slots_sparsecore_keeps(spec, bytes_per_row) -> None:
    """The planner's optimizer of a sparsecore spec is its name, and its bytes per row count the
    slot tables that spec's backends keep (element-wise and row-wise), by hand."""
    (table,) = tables_from_sparsecore_specs([TableSpec("t", 100, 8, optimizer=spec)])
    assert table.optimizer == spec.name
    assert row_bytes(table, 8) == bytes_per_row
    element = [s for s in spec.slot_names if s not in spec.row_slots]
    assert 4 * 8 * (1 + len(element)) + 4 * len(spec.row_slots) == bytes_per_row


def test_device_input_and_output_bytes_per_step():
    """Table-wise on one device: it looks up every id of the global batch (12-byte CSR entries)
    and returns every sample's pooled row; row-wise: each device 1/D of the ids and partial sums."""
    from torchrec_tpu.planner import EmbeddingTable, plan_tables
    from torchrec_tpu.topology import parse_accelerator_type

    batch, topology = 4096, parse_accelerator_type("v5p-8")  # 4 devices
    table = EmbeddingTable("t", rows=1000, dim=16, pooling_factor=3)
    owner = plan_tables([table], topology, batch, 4096, constraints={"t": ["table_wise"]})
    (device,) = [d for d in owner.devices if d.input_bytes]
    assert device.input_bytes == 12 * batch * 3 and device.output_bytes == batch * 4 * 16
    spread = plan_tables([table], topology, batch, 4096, constraints={"t": ["row_wise"]})
    assert {d.input_bytes for d in spread.devices} == {12 * batch * 3 // 4}
    assert {d.output_bytes for d in spread.devices} == {batch // 4 * 3 * 4 * 16}  # min(P, N) partial sums
