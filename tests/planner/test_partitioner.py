"""Placement, memory, infeasible inputs, determinism and plan JSON / TorchRec round trips."""

import random
import re

import pytest

from torchrec_tpu.planner import PlanningError, load_plan, plan_tables, to_torchrec_sharding_plan
from torchrec_tpu.planner.cost_model import OptionBuilder
from torchrec_tpu.planner.tables import EmbeddingTable, tables_from_configs
from torchrec_tpu.topology import parse_accelerator_type

V5P_8 = parse_accelerator_type("v5p-8")  # 4 devices


def _tables(n, seed=0):
    rng = random.Random(seed)
    return [EmbeddingTable(f"t{i}", rng.choice([1000, 10**5, 10**6, 5 * 10**6]), rng.choice([16, 64, 128]),
                           rng.choice([1.0, 4.0, 20.0]), rng.choice(["sgd", "adagrad", "adam"])) for i in range(n)]


def test_table_wise_tables_spread_over_devices():
    tables = [EmbeddingTable(f"t{i}", 4096, 64) for i in range(4)]
    plan = plan_tables(tables, V5P_8, 64, constraints={t.name: ["table_wise"] for t in tables})
    devices = sorted(plan.table(t.name).shards[0].device for t in tables)
    assert devices == [0, 1, 2, 3]  # identical tables: one per device
    times = {round(d.time_s, 12) for d in plan.devices}
    assert len(times) == 1  # perfectly balanced


def test_longest_first_placement():
    # a big table and three small ones on two devices: the big one alone, the small ones together
    topo = parse_accelerator_type("v6e-4x4")  # 16 devices; constrain to table-wise
    tables = [EmbeddingTable("big", 10**6, 128, 8.0)] + [EmbeddingTable(f"s{i}", 10**4, 128, 1.0) for i in range(20)]
    plan = plan_tables(tables, topo, 1024, constraints={t.name: ["table_wise"] for t in tables})
    big_device = plan.table("big").shards[0].device
    assert plan.devices[big_device].placed_tables == ("big",)


def test_memory_arithmetic_row_wise():
    # two SGD row-wise tables on v5p-8: rows padded to 8 * 16 = 128, dims to 8
    tables = [EmbeddingTable("a", 1000, 12), EmbeddingTable("b", 130, 8)]
    plan = plan_tables(tables, V5P_8, 64, constraints={"a": ["row_wise"], "b": ["row_wise"]})
    a_rows, b_rows = 1024 // 4, 256 // 4
    expected = a_rows * 16 * 4 + b_rows * 8 * 4
    assert [d.hbm_bytes for d in plan.devices] == [expected] * 4
    assert plan.table("a").shards[0].rows == 256 and plan.table("a").padded_dim == 16
    assert plan.table("a").hbm_bytes == 4 * a_rows * 64
    # one stack per distinct padded dim
    assert sorted(s.name for s in plan.stacks) == ["row_wise/d16/sgd/sum", "row_wise/d8/sgd/sum"]


def test_stacking_groups_equal_dim_and_optimizer():
    tables = [EmbeddingTable(f"t{i}", 10**5, 64, optimizer="adagrad") for i in range(3)]
    tables.append(EmbeddingTable("other", 10**5, 64, optimizer="sgd"))
    plan = plan_tables(tables, V5P_8, 64, constraints={t.name: ["row_wise"] for t in tables})
    stacks = {s.name: s.tables for s in plan.stacks}
    assert stacks == {"row_wise/d64/adagrad/sum": ("t0", "t1", "t2"), "row_wise/d64/sgd/sum": ("other",)}
    assert all(d.num_stacks == 2 for d in plan.devices)


def test_table_too_big_names_it_and_the_shortfall():
    topo = parse_accelerator_type("v6e-8")  # 8 devices, 32 GiB each, 28.8 GiB usable
    huge = EmbeddingTable("huge", 2_000_000_000, 128, optimizer="adam")  # 3 floats per element
    with pytest.raises(PlanningError) as err:
        plan_tables([huge], topo, 8)
    message = str(err.value)
    assert "'huge'" in message
    # row-wise over 16 SparseCores: 2e9 rows / 8 devices * 128 * 4 B * 3 = 357.63 GiB; usable 28.8
    shortfall = float(re.search(r"shortfall (\d+\.\d+) GiB", message).group(1))
    assert shortfall == pytest.approx(2e9 / 8 * 1536 / 2**30 - 28.8, abs=0.01)


def test_tables_that_fit_alone_but_not_together():
    topo = parse_accelerator_type("v6e-8")
    tables = [EmbeddingTable(f"t{i}", 200_000_000, 128) for i in range(10)]  # 95 GiB each
    with pytest.raises(PlanningError, match=r"shortfall \d+\.\d+ GiB per device"):
        plan_tables(tables, topo, 8)


def test_id_limit_rejects_and_warns():
    t = EmbeddingTable("hot", 10**6, 64, pooling_factor=100.0)
    with pytest.raises(PlanningError, match="ids per SparseCore partition"):
        plan_tables([t], V5P_8, 4096, constraints={"hot": ["table_wise"]})
    # row-wise: (1024 / 4) * 100 / 16 = 1600 ids per partition > 256, and a data-parallel replica's
    # SparseCores take every rank's ids (6400): no sharding is left
    with pytest.raises(PlanningError, match="row_wise needs 1600 ids per SparseCore partition"):
        plan_tables([t], V5P_8, 4096, max_ids_per_partition=256)
    plan = plan_tables([t], V5P_8, 4096, max_ids_per_partition=1600)
    # table-wise would be a little cheaper but needs (1024 / 4) * 100 / 4 = 6400: the warning says so
    assert plan.table("hot").sharding_type == "row_wise"
    assert any("'hot'" in w and "table_wise" in w and "6400" in w for w in plan.warnings)
    # a per-table limit (as FDO sets it) overrides the planner-wide one
    own = EmbeddingTable("hot", 10**6, 64, pooling_factor=100.0, max_ids_per_partition=1600)
    assert plan_tables([own], V5P_8, 4096, max_ids_per_partition=256).table("hot").sharding_type == "row_wise"


def test_memory_fits_only_beyond_the_id_limit():
    # v6e-8: 28.8 GiB usable; 40M x 128 Adagrad is 38.15 GiB, so only sharded options fit, and at
    # batch 8192 row-wise needs (1024 / 2) * 100 / 16 = 3200 ids per partition
    hot = EmbeddingTable("hot", 40_000_000, 128, pooling_factor=100.0, optimizer="adagrad")
    with pytest.raises(PlanningError, match=r"'hot': every sharding that fits in HBM exceeds the id limit; "
                                            r"row_wise needs 3200 ids"):
        plan_tables([hot], parse_accelerator_type("v6e-8"), 8192)


def test_id_limit_advice_stays_within_the_hardware():
    """Raising the limit is advice only up to the hardware's ceiling (4096 ids per partition)."""
    hot = EmbeddingTable("hot", 40_000_000, 128, pooling_factor=100.0, optimizer="adagrad")
    with pytest.raises(PlanningError) as raised:
        plan_tables([hot], parse_accelerator_type("v6e-8"), 8192)
    assert "raise --max-ids-per-partition (or the table's max_ids_per_partition) to >= 3200" in str(raised.value)
    with pytest.raises(PlanningError) as raised:
        plan_tables([hot], parse_accelerator_type("v6e-8"), 65536)  # 25600 ids per partition
    assert str(raised.value).endswith("(id limit 256); lower --batch-size or use more chips"), raised.value


def test_unsupported_constraint():
    with pytest.raises(PlanningError, match="none of which"):
        plan_tables([EmbeddingTable("t", 10, 8)], V5P_8, 64, constraints={"t": ["table_row_wise"]})


def test_deterministic_and_round_trip(tmp_path):
    tables = _tables(60)
    topo = parse_accelerator_type("v5p-32")
    first = plan_tables(tables, topo, 4096)
    second = plan_tables(list(tables), topo, 4096)
    assert first.to_json() == second.to_json()
    path = tmp_path / "plan.json"
    first.save(path)
    loaded = load_plan(path)
    assert loaded == first
    assert loaded.to_json() == path.read_text()


def test_plan_against_lower_bound_and_memory_limit():
    tables = _tables(200, seed=1)
    topo = parse_accelerator_type("v5p-128")
    plan = plan_tables(tables, topo, 16384)
    assert plan.lower_bound_s <= plan.step_time_s
    assert plan.quality < 1.25  # guards against search regressions; typical 1.0-1.1
    assert plan.max_memory_bytes <= plan.usable_hbm_bytes_per_device
    # every column of every placed table is covered exactly once
    for t in plan.tables:
        covered = sorted((s.column_offset, s.columns) for s in t.shards)
        assert sum(c for _, c in covered) == t.padded_dim


def test_torchrec_sharding_plan_conversion():
    from torchrec.distributed.types import ParameterSharding

    tables = [EmbeddingTable("rw", 1000, 12), EmbeddingTable("tw", 100, 16), EmbeddingTable("cw", 100, 32)]
    constraints = {"rw": ["row_wise"], "tw": ["table_wise"], "cw": ["column_wise"]}
    plan = plan_tables(tables, V5P_8, 64, constraints=constraints)
    sharding = to_torchrec_sharding_plan(plan, "sparse.ebc").plan["sparse.ebc"]
    rw: ParameterSharding = sharding["rw"]
    assert rw.sharding_type == "row_wise" and rw.ranks == [0, 1, 2, 3]
    sizes = [m.shard_sizes for m in rw.sharding_spec.shards]
    assert sizes == [[256, 12], [256, 12], [256, 12], [232, 12]]  # 1000 rows in blocks of 1024/4
    assert sharding["tw"].ranks == [plan.table("tw").shards[0].device]
    cw = sharding["cw"]
    assert [m.shard_offsets for m in cw.sharding_spec.shards] == [[0, s.column_offset] for s in plan.table("cw").shards]


def test_torchrec_configs_and_parameter_constraints():
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    configs = [EmbeddingBagConfig(num_embeddings=5000, embedding_dim=32, name="user", feature_names=["u1", "u2"])]
    (table,) = tables_from_configs(configs, {"user": 3.0}, optimizer="adagrad")
    assert (table.rows, table.dim, table.num_features, table.pooling_factor,
            table.optimizer) == (5000, 32, 2, 3.0, "adagrad")
    plan = plan_tables([table], V5P_8, 64, constraints={"user": ParameterConstraints(sharding_types=["column_wise"])})
    assert plan.table("user").sharding_type == "column_wise"


def test_thousand_tables_plan_quickly_enough_to_run_in_tests():
    tables = _tables(1000, seed=2)
    plan = plan_tables(tables, parse_accelerator_type("v5p-512"), 65536, max_ids_per_partition=1024)
    assert len(plan.devices) == 256 and len(plan.tables) == 1000
    assert OptionBuilder(parse_accelerator_type("v5p-512"), 65536).d == 256


def test_sparsecore_specs_convert():
    from sparsecore.optimizers import Adagrad
    from sparsecore.specs import FeatureSpec, TableSpec
    from torchrec_tpu.planner.tables import tables_from_sparsecore_specs

    specs = [TableSpec("items", vocab_size=10_000, dim=24, combiner="mean", optimizer=Adagrad(learning_rate=0.1))]
    features = [FeatureSpec("clicked", "items", batch_size=64, max_ids_per_sample=4),
                FeatureSpec("viewed", "items", batch_size=64, max_ids_per_sample=2)]
    (table,) = tables_from_sparsecore_specs(specs, features)
    assert (table.rows, table.dim, table.combiner, table.optimizer) == (10_000, 24, "mean", "adagrad")
    assert (table.num_features, table.pooling_factor, table.max_ids_per_partition) == (2, 3.0, 256)
    assert tables_from_configs(specs)[0].num_features == 1


def test_tpu7x_all_reduce_counts_chips_not_devices():
    t7 = parse_accelerator_type("tpu7x-8")  # 4 chips, 8 devices
    assert t7.allreduce_seconds_per_byte == pytest.approx(2 * 3 / 4 / 600e9)


def test_torchrec_planner_on_tpu_cost_model():
    from torchrec_tpu.planner.partitioner import Partitioner
    from torchrec_tpu.planner.torchrec_adapter import (
        SparseCoreShardEstimator,
        assignments_from_torchrec,
        plan_with_torchrec,
        torchrec_topology,
    )

    tables = _tables(8, seed=3)
    module_plan = plan_with_torchrec(tables, V5P_8, 1024, 4096)
    assert set(module_plan) == {t.name for t in tables}
    assert torchrec_topology(V5P_8).compute_device == "mtia" and torchrec_topology(V5P_8).world_size == 4
    scorer = Partitioner(V5P_8, 1024, 4096)
    theirs = scorer.evaluate(tables, assignments_from_torchrec(module_plan, tables, scorer.options.builder))
    ours = plan_tables(tables, V5P_8, 1024, 4096)
    assert theirs.lower_bound_s == pytest.approx(ours.lower_bound_s)
    assert theirs.step_time_s >= theirs.lower_bound_s
    # the estimator prices a row-wise shard exactly as the cost model's per-device row-wise load
    est = SparseCoreShardEstimator(None, tables={t.name: t for t in tables}, builder=scorer.options.builder)
    assert est.shard_load(tables[0], "row_wise", [0, 0]) == scorer.options.builder.row_wise(tables[0]).uniform


def test_zch_remaps_count_as_host_memory_per_shard(tmp_path):
    from torchrec_tpu.planner.report import summary_lines
    from torchrec_tpu.planner.tables import load_tables_file

    path = tmp_path / "tables.csv"
    path.write_text("name,rows,dim,zch\nowned,1000,16,lfu\nspread,4096,16,distance_lfu\nplain,5000,16,\n")
    tables = load_tables_file(path)
    plan = plan_tables(tables, V5P_8, 64,
                       constraints={"owned": ["table_wise"], "spread": ["row_wise"], "plain": ["table_wise"]})
    owner = plan.table("owned").shards[0].device
    # a slot: its raw id and slot (8 + 8 bytes) and the policy's metadata (LFU: a count, 8; distance-LFU: a
    # count and a last access, 16); the table-wise table's 1000 slots on its owner, the row-wise one's 4096 / 4
    # devices on each
    assert [d.host_bytes for d in plan.devices] == [1024 * 32 + (1000 * 24 if d.device == owner else 0)
                                                    for d in plan.devices]
    assert plan.max_host_bytes == 1024 * 32 + 24_000
    assert load_plan_text(plan, tmp_path).devices == plan.devices  # kept by the plan JSON
    lines = summary_lines(plan)
    assert any(line.startswith("host       max 0.00 GiB per device of managed-collision") for line in lines)
    plain = plan_tables(tables[2:], V5P_8, 64)
    assert all(d.host_bytes == 0 for d in plain.devices) and not any(
        line.startswith("host") for line in summary_lines(plain))
    with pytest.raises(ValueError, match=r"table 'bad': zch must be one of \['lfu', 'lru', 'distance_lfu'\] or empty, "
                                         r"got 'fifo'"):
        path.write_text("name,rows,dim,zch\nbad,10,4,fifo\n")
        load_tables_file(path)


def load_plan_text(plan, tmp_path):
    """``plan`` saved as JSON and loaded back."""
    plan.save(tmp_path / "plan.json")
    return load_plan(tmp_path / "plan.json")
