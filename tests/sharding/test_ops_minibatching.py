"""The ops backend under overflow="minibatch": a batch over a stack's partition limits runs as
jax-tpu-embedding's minibatches (k passes in a power-of-two count of slots) through the tpu:: ops,
eagerly and inside the one-program step, and trains exactly as the same backend whose limits were
large enough from the start (SGD bit-equal, the others within 1e-6), 0 ids dropped."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore import optimizers as opt
from sparsecore.csr_format import row_pointers_per_sc
from sparsecore.limits import PartitionOverflowError
from torchrec_tpu.sharding import ShardedSparseCoreEBC, TableSharding

torch_tpu = pytest.importorskip("torch_tpu")
import torch_tpu.compile as tc  # noqa: E402
from torchrec_tpu.sharding.step_lookup import PooledLookup  # noqa: E402

DIM, BATCH, SMALL, LARGE = 8, 64, 16, 1024
FEATURES = ["user", "item"]
CONFIGS = [EmbeddingBagConfig(num_embeddings=400, embedding_dim=DIM, name="t_user", feature_names=["user"],
                              pooling=PoolingType.SUM),
           EmbeddingBagConfig(num_embeddings=300, embedding_dim=DIM, name="t_item", feature_names=["item"],
                              pooling=PoolingType.MEAN)]
OPTIMIZERS = {"sgd": opt.SGD(0.2), "adagrad": opt.Adagrad(0.2), "rowwise_adagrad": opt.RowWiseAdagrad(0.2),
              "adam": opt.Adam(0.05), "ftrl": opt.FTRL(0.2)}


def skewed(step: int, burst: bool) -> KeyedJaggedTensor:
    """A batch with one hot user id in 30% of its samples; ``burst``: the item lengths 10x."""
    rng = np.random.default_rng(step)
    user_lengths = rng.integers(1, 4, size=BATCH)
    item_lengths = rng.integers(0, 2, size=BATCH) * (10 if burst else 1)
    users = rng.integers(0, 400, size=int(user_lengths.sum()))
    firsts = np.cumsum(user_lengths) - user_lengths
    users[firsts[rng.random(BATCH) < 0.3]] = 7
    items = rng.integers(0, 300, size=int(item_lengths.sum()))
    return KeyedJaggedTensor(keys=FEATURES, values=torch.from_numpy(np.concatenate([users, items])),
                             lengths=torch.from_numpy(np.concatenate([user_lengths, item_lengths])))


def ebc(limit: int, optimizer: opt.OptimizerSpec, overflow: str) -> ShardedSparseCoreEBC:
    torch.manual_seed(0)
    stock = EmbeddingBagCollection(tables=CONFIGS, device=torch.device("cpu"))
    return ShardedSparseCoreEBC.from_torchrec(stock, BATCH, {c.name: TableSharding("table_wise", (0,))
                                                             for c in CONFIGS}, optimizer,
                                              partition_limits={c.name: (limit, limit) for c in CONFIGS},
                                              backend="ops", overflow=overflow)


def slots_of(module: ShardedSparseCoreEBC, prepared) -> list[int]:
    """Each stack's minibatch slots in a prepared batch (1: one pass)."""
    backend = module._backend
    chunks = backend.plan.topology.num_sparsecores
    return [int(prepared.csr[4 * i].shape[0]) // (chunks * row_pointers_per_sc(st))
            for i, st in enumerate(backend.plan.stacks)]


def assert_trained_alike(name: str, got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for table, weight in expected.items():
        if name == "sgd":
            assert torch.equal(got[table], weight), table
        else:
            torch.testing.assert_close(got[table], weight, rtol=1e-6, atol=1e-6, msg=table)


def _optimizer_params():
    return [pytest.param(name, marks=pytest.mark.slow) for name in OPTIMIZERS]


@pytest.mark.parametrize("name", _optimizer_params())
def test_eager_minibatched_steps_equal_large_limits(name: str) -> None:
    """Forward and fused update, step after step, on batches over the limits: equal to large limits;
    "error" refuses the same batch."""
    small, large = ebc(SMALL, OPTIMIZERS[name], "minibatch"), ebc(LARGE, OPTIMIZERS[name], "error")
    splits = []
    for step in range(3):
        kjt = skewed(step, burst=step == 1)
        outs = []
        for module in (small, large):
            pooled = module(kjt).values()
            pooled.backward(torch.ones_like(pooled) + pooled.detach())
            outs.append(pooled.detach())
        splits.append(max(slots_of(small, small.input_dist(kjt, training=False).prepared)))
        assert torch.equal(outs[0], outs[1])  # lookups sum in one pass's order: bit-equal
        assert all(s.dropped_ids == 0 for s in small._backend.last_stats.values())
    assert max(splits) > 1
    assert_trained_alike(name, small.unsharded_weights(), large.unsharded_weights())
    with pytest.raises(PartitionOverflowError, match="max_ids_per_partition"):
        ebc(SMALL, OPTIMIZERS[name], "error")(skewed(0, burst=True))


class PooledLoss(nn.Module):
    def __init__(self, lookup: PooledLookup) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.weight = nn.Parameter(torch.randn(len(FEATURES), DIM))
        self.lookup = lookup

    def forward(self, y, anchor, *csr):
        return (((self.lookup(anchor, *csr) * self.weight).sum(dim=(1, 2)) - y) ** 2).mean()


def train_in_one_program(limit: int, overflow: str, steps: int) -> tuple[list[float], dict, list[int], list[int]]:
    """SGD tables trained by a step program that runs lookup, dense step and fused update; returns
    the losses, tables, each batch's largest minibatch slots and the compiles after each step."""
    module = ebc(limit, OPTIMIZERS["sgd"], overflow)
    lookup = PooledLookup.of(module, FEATURES)
    model = PooledLoss(lookup).to("tpu")
    step = tc.train_step(model, torch.optim.SGD([model.weight], lr=0.05))
    losses, slots, compiles = [], [], []
    for i in range(steps):
        local = module.prefetch(skewed(i, burst=i % 3 == 1)).local
        slots.append(max(slots_of(module, local.prepared)))
        y = torch.from_numpy(np.random.default_rng(i).normal(size=BATCH).astype(np.float32))
        loss = step(y, *lookup.step_inputs(local))
        losses.append(loss.item())
        compiles.append(step.stats.compiles)
    return losses, module.unsharded_weights(), slots, compiles


@pytest.mark.slow
def test_one_program_step_minibatches_with_few_programs() -> None:
    """Inside the one-program step: bit-equal to large limits, and one program per slot count
    (a power of two), not per batch."""
    losses, tables, slots, compiles = train_in_one_program(SMALL, "minibatch", 6)
    ref_losses, ref_tables, _, _ = train_in_one_program(LARGE, "error", 6)
    assert losses == ref_losses
    assert_trained_alike("sgd", tables, ref_tables)
    assert all(s & (s - 1) == 0 for s in slots)
    split = [i for i, s in enumerate(slots) if s > 1]
    assert len(split) > 1 and len({slots[i] for i in split}) == 1
    assert compiles[split[-1]] == compiles[split[-1] - 1]  # its program was compiled for the first one
