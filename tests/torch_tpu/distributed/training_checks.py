"""Rank body for the training tests: DDP, FSDP2 and DTensor on ``tpu_dist`` vs one CPU process.

Every strategy trains the same MLP from the same init on the same global batches with SGD; the
reference trains it unsharded on the full batch in a single CPU process. With equal per-rank
shards, averaging gradients over ranks equals the full-batch gradient, so parameters must agree.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

STEPS = 4
GLOBAL_BATCH = 8
LR = 0.1


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def _train(model: nn.Module, inputs: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    losses = []
    for step in range(STEPS):
        x, y = inputs(step)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach().cpu()))
    return losses


def reference() -> dict[str, torch.Tensor]:
    """Unsharded full-batch training in this (CPU) process."""
    model = make_model()
    _train(model, batch)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _shard(rank: int, size: int, device: str) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    rows = GLOBAL_BATCH // size

    def inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch(step)
        return x[rank * rows:(rank + 1) * rows].to(device), y[rank * rows:(rank + 1) * rows].to(device)

    return inputs


def _full(rank: int, size: int, device: str) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    return lambda step: tuple(t.to(device) for t in batch(step))


def _cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def ddp(rank: int, size: int, device: str) -> dict[str, torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    # Tiny buckets: several allreduces per step, each on a flat bucket the grads are views of.
    model = DDP(make_model().to(device), gradient_as_bucket_view=True, bucket_cap_mb=0.0005)
    _train(model, _shard(rank, size, device))
    return _cpu_state(model.module)


def fsdp2(rank: int, size: int, device: str) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device, (size,))
    model = make_model().to(device)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(model, _shard(rank, size, device))
    state = {}
    for name, param in model.state_dict().items():
        local = param.to_local()  # dim-0 shards; every dim 0 here divides evenly by the size
        full = torch.empty((size * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=device)
        dist.all_gather_into_tensor(full, local.contiguous())
        state[name] = full.cpu()
    return state


def dtensor(rank: int, size: int, device: str) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh(device, (size,))
    model = parallelize_module(
        make_model().to(device), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    _train(model, _full(rank, size, device))
    return {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}


def redistribute(rank: int, size: int, device: str) -> dict[str, torch.Tensor]:
    """distribute_tensor / redistribute / full_tensor round trips of a known tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(device, (size,))
    full = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    rows = distribute_tensor(full.to(device), mesh, [Shard(0)])
    out = {
        "local_rows": rows.to_local().cpu(),
        "rows_to_cols": rows.redistribute(mesh, [Shard(1)]).to_local().cpu(),
        "rows_to_replicate": rows.redistribute(mesh, [Replicate()]).to_local().cpu(),
        "full": rows.full_tensor().cpu(),
    }
    partial = DTensor.from_local(full.to(device) * (rank + 1), mesh, [Partial()])
    out["partial_sum"] = partial.redistribute(mesh, [Replicate()]).to_local().cpu()
    return out


def topology_mesh(rank: int, size: int, device: str) -> dict[str, object]:
    """A DeviceMesh from topology_aware_mesh (2 chips of a v6e 2x1 slice) carries collectives."""
    from torch_tpu.distributed import topology_aware_mesh
    from tpu_facts import Slice, chip_generation

    layout = topology_aware_mesh({"dp": size}, topology=Slice(chip_generation("v6e"), (size, 1)))
    mesh = layout.device_mesh(device)
    t = torch.full((3,), float(rank + 1), device=device)
    dist.all_reduce(t, group=mesh.get_group("dp"))
    return {"sum": t.cpu(), "mesh": mesh.mesh.tolist(), "names": mesh.mesh_dim_names}


def _sharded_ebc(group: dist.ProcessGroup) -> nn.Module:
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingEnv, ShardingType

    kinds = {"t0": ShardingType.TABLE_WISE, "t1": ShardingType.COLUMN_WISE, "t2": ShardingType.TABLE_WISE}
    tables = [
        torchrec.EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=40, feature_names=[f"f{n}"])
        for n in kinds
    ]
    torch.manual_seed(0)
    ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    constraints = {n: ParameterConstraints(sharding_types=[k.value]) for n, k in kinds.items()}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=group.size(), compute_device="cpu"), constraints=constraints
    )
    plan = planner.collective_plan(ebc, None, group)
    torch.manual_seed(0)
    return DistributedModelParallel(
        ebc, env=ShardingEnv.from_process_group(group), device=torch.device("cpu"), plan=plan
    )


def torchrec_sharding(rank: int, size: int, device: str) -> dict[str, list[torch.Tensor]] | None:
    """TorchRec DMP (table- and column-wise, fused SGD) on tpu_dist vs the same on gloo (CPU)."""
    import torchrec

    if device != "cpu":
        return None  # torchrec 1.8 has no "tpu" compute device
    gloo = dist.new_group(backend="gloo")
    g = torch.Generator().manual_seed(rank)
    lengths = torch.randint(0, 4, (3 * 4,), generator=g)
    values = torch.randint(0, 40, (int(lengths.sum()),), generator=g)
    kjt = torchrec.KeyedJaggedTensor(keys=["ft0", "ft1", "ft2"], values=values, lengths=lengths)
    out: dict[str, list[torch.Tensor]] = {}
    for name, group in (("ours", dist.group.WORLD), ("gloo", gloo)):
        model, steps = _sharded_ebc(group), []
        for _ in range(2):  # the second forward sees the first backward's fused update
            pooled = model(kjt).values()
            (pooled * pooled).sum().backward()
            steps.append(pooled.detach().clone())
        out[name] = steps
    return out


STRATEGIES = {"ddp": ddp, "fsdp2": fsdp2, "dtensor": dtensor, "redistribute": redistribute,
              "topology_mesh": topology_mesh, "torchrec": torchrec_sharding}


def run_strategies(rank: int, size: int, device: str) -> dict:
    """Each strategy's final CPU state (or round-trip results), or its error text."""
    results: dict[str, object] = {}
    for name, fn in STRATEGIES.items():
        try:
            results[name] = fn(rank, size, device)
        except Exception as exc:  # reported per strategy by the test, with the rank
            results[name] = f"{type(exc).__name__}: {exc}"
    return results
