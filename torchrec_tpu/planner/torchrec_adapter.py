"""Run TorchRec's own planner (enumerator, proposers, greedy partitioner) on the TPU cost model.

TorchRec 1.8 asserts on ``Topology(compute_device="tpu")``; we use its **"mtia" proxy**, the
device class whose semantics match a TPU's (tables in HBM, row-wise offered, no UVM caching), and
replace its GPU perf/storage estimators with ``SparseCoreShardEstimator``, which prices every
TorchRec shard with ``cost_model.OptionBuilder``. ``assignments_from_torchrec`` turns the
resulting ``ShardingPlan`` back into cost-model options so both planners are scored alike
(``Partitioner.evaluate``, over ``TableOptions.builder``). Used by ``bench/bench_planner.py``; our
own search is the default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torchrec_tpu.planner.cost_model import Load, OptionBuilder, ShardingOption
from torchrec_tpu.planner.tables import EmbeddingTable
from torchrec_tpu.topology import TPUTopology
from tpu_facts import DEFAULT_MAX_IDS_PER_PARTITION

PROXY_DEVICE = "mtia"
SUPPORTED = ("table_wise", "column_wise", "row_wise")  # what "mtia" sharders offer that we cost


def torchrec_topology(topology: TPUTopology) -> Any:
    """A TorchRec ``Topology`` for the slice: one rank per JAX device, HBM = device HBM."""
    from torchrec.distributed.planner.types import Topology

    return Topology(
        world_size=topology.num_devices,
        compute_device=PROXY_DEVICE,
        hbm_cap=topology.hbm_bytes_per_device,
        ddr_cap=0,
        local_world_size=topology.chip.chips_per_host * topology.chip.devices_per_chip,
        hbm_mem_bw=topology.sparsecore_bandwidth_per_device,
        intra_host_bw=topology.chip.ici_bandwidth_bytes_per_s,
        inter_host_bw=topology.chip.ici_bandwidth_bytes_per_s,
    )


def _estimator_base() -> type:
    from torchrec.distributed.planner.types import ShardEstimator

    return ShardEstimator


class SparseCoreShardEstimator(_estimator_base()):  # type: ignore[misc]
    """TorchRec ``ShardEstimator`` filling each shard's perf and storage from the TPU cost model.

    A row-wise shard costs the per-device row-wise load; a table-/column-wise shard costs its
    column block's owner load plus the block's share of the all-to-all every device pays.
    """

    def __init__(self, topology: Any, constraints: Any = None, *, tables: Mapping[str, EmbeddingTable],
                 builder: OptionBuilder) -> None:
        self._tables = tables
        self._builder = builder

    def estimate(self, sharding_options: list[Any], sharder_data_map: Any = None) -> None:
        from torchrec.distributed.planner.types import Perf, Storage

        for so in sharding_options:
            table = self._tables[so.name]
            for shard in so.shards:
                load = self.shard_load(table, so.sharding_type, shard.size)
                shard.perf = Perf(fwd_compute=load.lookup_s, fwd_comms=load.comm_s, bwd_compute=0.0, bwd_comms=0.0)
                shard.storage = Storage(hbm=int(load.memory_bytes), ddr=0)

    def shard_load(self, table: EmbeddingTable, sharding_type: str, size: Sequence[int]) -> Load:
        if sharding_type == "row_wise":
            return self._builder.row_wise(table).uniform
        if sharding_type in ("table_wise", "column_wise"):
            option = self._builder.column_blocks(table, [int(size[1])])
            return option.shards[0].load + option.uniform.scaled(self._builder.d)
        raise ValueError(f"table {table.name!r}: sharding {sharding_type!r} is not costed; allowed {SUPPORTED}")


def plan_with_torchrec(tables: Sequence[EmbeddingTable], topology: TPUTopology, batch_size: int,
                       max_ids_per_partition: int = DEFAULT_MAX_IDS_PER_PARTITION) -> Any:
    """TorchRec's ``EmbeddingShardingPlanner`` on a meta-device EBC of ``tables``; returns the
    ``EmbeddingModuleShardingPlan`` of the EBC."""
    import torch
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    builder = OptionBuilder(topology, batch_size, max_ids_per_partition)
    tr_topology = torchrec_topology(topology)
    by_name = {t.name: t for t in tables}
    constraints = {
        t.name: ParameterConstraints(sharding_types=list(SUPPORTED), compute_kernels=["fused"],
                                     pooling_factors=[t.pooling_factor] * t.num_features)
        for t in tables
    }
    local_batch = batch_size // topology.num_devices
    estimator = SparseCoreShardEstimator(tr_topology, constraints, tables=by_name, builder=builder)
    enumerator = EmbeddingEnumerator(tr_topology, local_batch, constraints, estimator=[estimator])
    planner = EmbeddingShardingPlanner(
        topology=tr_topology, batch_size=local_batch, enumerator=enumerator, constraints=constraints,
        storage_reservation=FixedPercentageStorageReservation(topology.costs.hbm_reserved_fraction),
    )
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=t.name, num_embeddings=t.rows, embedding_dim=t.dim,
                                   feature_names=[f"{t.name}.f{i}" for i in range(t.num_features)]) for t in tables],
        device=torch.device("meta"),
    )
    plan = planner.plan(ebc, [EmbeddingBagCollectionSharder()])
    return next(iter(plan.plan.values()))


def assignments_from_torchrec(module_plan: Mapping[str, Any], tables: Sequence[EmbeddingTable],
                              builder: OptionBuilder) -> dict[str, tuple[ShardingOption, tuple[int, ...]]]:
    """Cost-model options for a TorchRec plan (row-wise over all ranks -> our row-wise)."""
    out = {}
    for t in tables:
        ps = module_plan[t.name]
        if ps.sharding_type == "row_wise":
            out[t.name] = (builder.row_wise(t), ())
            continue
        if ps.sharding_type not in ("table_wise", "column_wise"):
            raise ValueError(f"table {t.name!r}: TorchRec chose {ps.sharding_type}, which is not costed")
        shards = sorted(ps.sharding_spec.shards, key=lambda m: m.shard_offsets[1])
        option = builder.column_blocks(t, [m.shard_sizes[1] for m in shards])
        out[t.name] = (option, tuple(int(str(m.placement).split(":")[1].split("/")[0]) for m in shards))
    return out
