"""Why stock DMP with ``UNFUSED_TPU`` does not train its tables (issue 49, the failing slow test in
test_unfused_dmp.py): TorchRec 1.9.2's ``BatchedTPUEmbeddingBag`` leaves ``_param_per_table`` empty, so
``ShardedEmbeddingBagCollection`` registers an empty ``nn.Parameter`` placeholder per table and
``DistributedModelParallel.parameters()`` never yields the kernels' weights, although backward gives
them gradients. An optimizer built over ``dmp.parameters()`` (as TorchRec's own MLPerf DLRM-v2 TPU
benchmark does) updates the dense part only. Shown on CPU over gloo, without torch_tpu: the cause is
in TorchRec. When a TorchRec release registers the tables, this test fails and the pin goes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.torchrec_192.unfused_dmp_checks import BATCH, MULTI_HOT, ROWS, global_batches


def test_stock_dmp_unfused_tpu_registers_empty_table_parameters_while_kernels_get_gradients() -> None:
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=32, num_embeddings=rows, feature_names=[f"f{i}"])
              for i, rows in enumerate(ROWS)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    sharder = EmbeddingBagCollectionSharder()
    plan = ShardingPlan({"": construct_module_sharding_plan(
        ebc, per_param_sharding={t.name: column_wise(ranks=[0], compute_kernel=EmbeddingComputeKernel.UNFUSED_TPU.value)
                                 for t in tables},
        sharder=sharder, local_size=1, world_size=1, device_type="cpu")})
    assert not dist.is_initialized(), "this test makes its own single-rank default group"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dmp = DistributedModelParallel(module=ebc, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                       device=torch.device("cpu"), plan=plan, sharders=[sharder])
        registered = dict(dmp.named_parameters())
        assert {name: tuple(p.shape) for name, p in registered.items()} == {
            f"embedding_bags.t{i}.weight": (0,) for i in range(len(ROWS))}

        _, _, ids = global_batches(1)[0]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(len(ROWS))], values=torch.cat([x.reshape(-1) for x in ids]),
            lengths=torch.cat([torch.full((BATCH,), hot) for hot in MULTI_HOT]))
        dmp(kjt).values().sum().backward()
        kernel_weights = [p for lookup in dmp.module._lookups for _, p in lookup.named_parameters()]
        assert [tuple(p.shape) for p in kernel_weights] == [(rows, 32) for rows in ROWS]
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in kernel_weights)
        assert not {id(p) for p in kernel_weights} & {id(p) for p in dmp.parameters()}
    finally:
        dist.destroy_process_group()
