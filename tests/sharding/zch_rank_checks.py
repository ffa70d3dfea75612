"""What each rank of the 2-rank managed-collision test runs (module level, so spawned ranks import
it): stock TorchRec's sharded ``ManagedCollisionEmbeddingBagCollection`` (DMP with its own
sharder, row-wise, fused SGD, over gloo) and ours over tpu_dist, on the same raw-id stream. Each
returns per step its pooled outputs and every table's remap state (sorted raw ids, the slot of
each, local to the rank), then its local table shards."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from .reference import CONFIGS, FEATURES, slice_batch, targets

LOCAL_BATCH, STEPS, LR, RESET = 8, 6, 0.3, 0.05
INPUT_HASH_SIZE = 2**38  # TorchRec routes an id below it by id // 2**37, one past it by id mod 2
POLICIES = {"t_user": ("lfu", 2), "t_item": ("distance_lfu", 1), "t_small": ("lru", 1)}


def raw_kjt(step: int, batch: int = 2 * LOCAL_BATCH) -> KeyedJaggedTensor:
    """A global batch of raw ids drifting upward, on both sides of the routing range."""
    rng = np.random.default_rng(step)
    lengths = rng.integers(0, 4, size=(len(FEATURES), batch))
    base = np.floor(np.exp(rng.uniform(0, 4, size=int(lengths.sum())))).astype(np.int64) + 3 * step
    return KeyedJaggedTensor(keys=FEATURES, values=torch.from_numpy(base * 0x1FFFFFFF7),
                             lengths=torch.from_numpy(lengths.reshape(-1)))


def specs() -> dict:
    from torchrec_tpu.sharding.zch import ZchSpec

    return {name: ZchSpec(policy, interval, input_hash_size=INPUT_HASH_SIZE)
            for name, (policy, interval) in POLICIES.items()}


def _local(rank: int, step: int) -> KeyedJaggedTensor:
    return slice_batch(raw_kjt(step), rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)


def _loss(out: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    target = targets(2 * LOCAL_BATCH, step)[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]
    return 0.5 * ((out - target) ** 2).sum()


def _configs() -> list:
    from torchrec import PoolingType

    return [dataclasses.replace(c, pooling=PoolingType.SUM, init_fn=_reset) for c in CONFIGS]


def _reset(weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.init.constant_(weight, RESET)


def initial_weights() -> dict[str, torch.Tensor]:
    """The tables as TorchRec numbers their rows (rank r's shard: a contiguous block)."""
    torch.manual_seed(0)
    return {c.name: torch.randn(c.num_embeddings, c.embedding_dim) * 0.1 for c in CONFIGS}


def our_row_order(weights: dict[str, torch.Tensor], world_size: int) -> dict[str, torch.Tensor]:
    """``weights`` with rows in our row-wise order: the shard of rank r holds rows r mod W, where
    TorchRec's holds the block [r * ceil(N / W), ...); local row k is the same row in both."""
    out = {}
    for name, weight in weights.items():
        rows, block = weight.shape[0], -(-weight.shape[0] // world_size)
        ours = torch.arange(rows)
        out[name] = weight[(ours % world_size) * block + ours // world_size]
    return out


def stock_rank(rank: int, world_size: int, store, timeout, steps: int = STEPS):
    """Stock TorchRec's sharded MC-EBC on this rank, trained ``steps`` steps."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import ManagedCollisionCollection, MCHManagedCollisionModule

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    cpu = torch.device("cpu")
    ebc = EmbeddingBagCollection(tables=_configs(), device=cpu)
    mcc = ManagedCollisionCollection(
        {name: MCHManagedCollisionModule(zch_size=c.num_embeddings, device=cpu, eviction_policy=spec.eviction_policy(),
                                         eviction_interval=spec.eviction_interval, input_hash_size=spec.input_hash_size)
         for (name, spec), c in zip(specs().items(), CONFIGS)}, ebc.embedding_bag_configs())
    module = ManagedCollisionEmbeddingBagCollection(ebc, mcc, return_remapped_features=False)
    sharder = ManagedCollisionEmbeddingBagCollectionSharder()
    sharder._e_sharder._fused_params = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}
    plan = ShardingPlan({"": construct_module_sharding_plan(
        module, per_param_sharding={c.name: row_wise(compute_kernel="fused") for c in CONFIGS}, sharder=sharder,
        local_size=world_size, world_size=world_size, device_type="cpu")})
    dmp = DistributedModelParallel(module=module, env=ShardingEnv.from_process_group(dist.group.WORLD), device=cpu,
                                   plan=plan, sharders=[sharder])
    full = initial_weights()
    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            if key.endswith(".weight"):
                for shard in value.local_shards():
                    (row, _), (rows, _) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(full[key.split(".")[-2]][row:row + rows])
    remaps = dmp._dmp_wrapped_module._managed_collision_collection._managed_collision_modules
    out_steps = []
    for step in range(steps):
        out = dmp(_local(rank, step))
        out = (out[0] if isinstance(out, tuple) else out).wait().values()
        _loss(out, rank, step).backward()
        out_steps.append((out.detach().clone(), {name: (m._mch_sorted_raw_ids.clone(),
                                                    m._mch_remapped_ids_mapping - m._output_global_offset)
                                             for name, m in remaps.items()}))
    tables = {}
    for key, value in dmp.state_dict().items():
        if key.endswith(".weight"):
            tables[key.split(".")[-2]] = value.local_shards()[0].tensor.detach().clone()
    dist.destroy_process_group()
    return out_steps, tables


def ours(steps: int, resume_at: int | None = None):
    """Our EBC on this rank (in a process group) trained ``steps`` steps; ``resume_at``: a
    second EBC takes the first's state dict after that many steps and trains the rest."""
    from sparsecore import SGD
    from sparsecore.specs import Initializer
    from torchrec_tpu.sharding import ShardedSparseCoreEBC, TableSharding
    from torchrec_tpu.sharding.ebc import ShardedSparseCoreEBC as EBC

    def make() -> EBC:
        from torchrec import EmbeddingBagCollection

        ebc = EmbeddingBagCollection(tables=_configs(), device=torch.device("cpu"))
        tables, features = ShardedSparseCoreEBC.specs_of(ebc, LOCAL_BATCH, SGD(LR))
        tables = [dataclasses.replace(t, initializer=Initializer("constant", value=RESET)) for t in tables]
        plan = {c.name: TableSharding("row_wise") for c in CONFIGS}
        # (TorchRec's comm ops divide the tables' gradients by the world size: GRADIENT_DIVISION)
        sharded = ShardedSparseCoreEBC(tables, features, plan, weights=our_row_order(initial_weights(), 2),
                                       backend="fbgemm", average_over_ranks=True)
        sharded.manage_collisions(specs())
        return sharded

    rank = dist.get_rank()
    ebc, out = make(), []
    for step in range(steps):
        if step == resume_at:
            resumed = make()
            resumed.load_state_dict(ebc.state_dict())
            ebc = resumed
        pooled = ebc(_local(rank, step)).values()
        _loss(pooled, rank, step).backward()
        out.append((pooled.detach().clone(), {name: (remap.sorted_ids.clone(), remap.slot_of.clone())
                                              for name, remap in ebc.zch.collection.remaps.items()}))
    tables = {name: w.clone() for name, w in ebc.local_backend.table_weights().items()}
    return out, tables, ebc.state_dict()[f"zch_state.rank{rank}_of_2"]


def our_rank(rank: int, world_size: int, store, timeout, resume_at: int | None = None, steps: int = STEPS):
    from .rank_checks import tpu_dist_group

    with tpu_dist_group(rank, world_size, store, timeout):
        return ours(steps, resume_at)
