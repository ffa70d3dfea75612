"""The sparsecore EBC's lookup on the tpu:: ops called by a traced training step (one XLA program
per step: lookup, dense step, fused embedding update) trains like stock TorchRec + dense torch
optimizers on the host, and like the EBC's own (unfused) lookup and update on the same ops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore import Adagrad
from torchrec_tpu.sharding import ShardedSparseCoreEBC, TableSharding

torch_tpu = pytest.importorskip("torch_tpu")
import torch_tpu.compile as tc  # noqa: E402
from torchrec_tpu.sharding.step_lookup import PooledLookup  # noqa: E402

DIM, BATCH, STEPS = 8, 16, 3
CONFIGS = [
    EmbeddingBagConfig(num_embeddings=40, embedding_dim=DIM, name="t_user", feature_names=["user"],
                       pooling=PoolingType.SUM),
    EmbeddingBagConfig(num_embeddings=30, embedding_dim=DIM, name="t_item", feature_names=["item", "hist"],
                       pooling=PoolingType.MEAN),
    EmbeddingBagConfig(num_embeddings=9, embedding_dim=DIM, name="t_small", feature_names=["small"],
                       pooling=PoolingType.SUM),
]
FEATURES = ["user", "item", "hist", "small"]
VOCAB = {"user": 40, "item": 30, "hist": 30, "small": 9}
SPARSE_ARCH_ORDER = ["small", "hist", "user", "item"]  # not the EBC's output order
LR_TABLES, LR_DENSE = 0.2, 0.05
SHARDINGS = {
    "table_wise": {c.name: TableSharding("table_wise", (0,)) for c in CONFIGS},
    "mixed": {"t_user": TableSharding("row_wise"), "t_item": TableSharding("data_parallel"),
              "t_small": TableSharding("column_wise", (0,))},
}


class DenseLoss(nn.Module):
    """loss(dense x, pooled [B, F, D], y): a linear read of the pooled embeddings and dense input."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.pooled_weight = nn.Parameter(torch.randn(len(FEATURES), DIM))
        self.dense = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor, pooled: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logit = (pooled * self.pooled_weight).sum(dim=(1, 2)) + self.dense(x).squeeze(-1)
        return ((logit - y) ** 2).mean()


def batch(step: int) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    rng = np.random.default_rng(step)
    lengths = rng.integers(0, 4, size=(len(FEATURES), BATCH))
    values = np.concatenate([rng.integers(0, VOCAB[f], size=int(lengths[i].sum())) for i, f in enumerate(FEATURES)])
    kjt = KeyedJaggedTensor(keys=FEATURES, values=torch.from_numpy(values), lengths=torch.from_numpy(lengths.ravel()))
    return torch.from_numpy(rng.normal(size=(BATCH, 3)).astype(np.float32)), kjt, \
        torch.from_numpy(rng.normal(size=BATCH).astype(np.float32))


def stock_ebc() -> EmbeddingBagCollection:
    torch.manual_seed(0)
    return EmbeddingBagCollection(tables=CONFIGS, device=torch.device("cpu"))


def sparse_arch(pooled: dict[str, torch.Tensor]) -> torch.Tensor:
    """TorchRec SparseArch's [B, F, D] layout of per-feature pooled embeddings."""
    return torch.cat([pooled[name] for name in SPARSE_ARCH_ORDER], dim=1).reshape(BATCH, len(FEATURES), DIM)


def train_reference() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Stock TorchRec EBC and the dense model on the host, dense torch Adagrad/SGD."""
    ebc, dense = stock_ebc(), DenseLoss()
    tables = torch.optim.Adagrad(ebc.parameters(), lr=LR_TABLES, initial_accumulator_value=0.0, eps=1e-8)
    dense_opt = torch.optim.SGD(dense.parameters(), lr=LR_DENSE)
    losses = []
    for step in range(STEPS):
        x, kjt, y = batch(step)
        tables.zero_grad()
        dense_opt.zero_grad()
        loss = dense(x, sparse_arch(ebc(kjt).to_dict()), y)
        loss.backward()
        tables.step()
        dense_opt.step()
        losses.append(loss.item())
    return losses, {n: b.weight.detach().clone() for n, b in ebc.embedding_bags.items()}, \
        {n: p.detach().clone() for n, p in dense.named_parameters()}


def sparsecore_ebc(sharding: str, backend: str = "ops") -> ShardedSparseCoreEBC:
    return ShardedSparseCoreEBC.from_torchrec(stock_ebc(), BATCH, SHARDINGS[sharding],
                                              Adagrad(LR_TABLES, initial_accumulator_value=0.0, eps=1e-8),
                                              backend=backend)


class LookupLoss(nn.Module):
    """loss(x, y, anchor, *csr): the EBC's lookup inside the step feeding ``DenseLoss``."""

    def __init__(self, dense: DenseLoss, lookup: PooledLookup) -> None:
        super().__init__()
        self.dense, self.lookup = dense, lookup

    def forward(self, x, y, anchor, *csr):
        return self.dense(x, self.lookup(anchor, *csr), y)



def fused_step(ebc: ShardedSparseCoreEBC, dense: DenseLoss) -> tuple[PooledLookup, tc.TrainStep]:
    lookup = PooledLookup.of(ebc, SPARSE_ARCH_ORDER)
    return lookup, tc.train_step(LookupLoss(dense, lookup), torch.optim.SGD(dense.parameters(), lr=LR_DENSE),
                                 input_grads=(2,))


def train_fused(sharding: str) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor], tc.TrainStep]:
    """The EBC's lookup and update inside one compiled step per batch, dense model on tpu."""
    ebc, dense = sparsecore_ebc(sharding), DenseLoss().to("tpu")
    lookup, step = fused_step(ebc, dense)
    losses = []
    for i in range(STEPS):
        x, kjt, y = batch(i)
        loss, _ = step(x, y, *lookup.step_inputs(ebc.prefetch(kjt).local))
        losses.append(loss.item())
    assert ebc.steps == STEPS and ebc._backend.steps == STEPS
    return losses, ebc.unsharded_weights(), {n: p.cpu() for n, p in dense.named_parameters()}, step


@pytest.mark.parametrize("sharding", list(SHARDINGS))
def test_fused_step_trains_like_stock_torchrec(sharding: str) -> None:
    losses, tables, dense = train_reference()
    got_losses, got_tables, got_dense, step = train_fused(sharding)
    assert step.stats.calls == STEPS and step.stats.compiles == 1
    torch.testing.assert_close(got_losses, losses, rtol=0, atol=1e-5)
    assert got_tables.keys() == tables.keys()
    for name, weight in tables.items():
        assert not torch.equal(weight, stock_ebc().embedding_bags[name].weight)  # trained
        torch.testing.assert_close(got_tables[name], weight, rtol=0, atol=1e-5, msg=name)
    for name, value in dense.items():
        torch.testing.assert_close(got_dense[name], value, rtol=0, atol=1e-5, msg=name)


def test_fused_step_equals_the_ebc_own_lookup_and_update() -> None:
    """The same ops as the EBC's eager path (lookup op, then the fused op from the pooled
    gradient): the same numbers up to float32 rounding."""
    ebc, dense = sparsecore_ebc("mixed"), DenseLoss().to("tpu")
    step = tc.train_step(dense, torch.optim.SGD(dense.parameters(), lr=LR_DENSE), input_grads=(1,))
    for i in range(STEPS):
        x, kjt, y = batch(i)
        pooled = sparse_arch(ebc(kjt).to_dict())
        _, (grad,) = step(x, pooled.detach(), y)
        pooled.backward(grad.cpu())
    _, fused_tables, fused_dense, _ = train_fused("mixed")
    for name, weight in ebc.unsharded_weights().items():
        torch.testing.assert_close(fused_tables[name], weight, rtol=0, atol=1e-6, msg=name)
    for name, value in dense.named_parameters():
        torch.testing.assert_close(fused_dense[name], value.cpu(), rtol=0, atol=1e-6, msg=name)


def test_only_ops_ebcs_with_one_dim_fuse_and_the_others_say_why() -> None:
    with pytest.raises(ValueError, match="Linear is not a ShardedSparseCoreEBC"):
        PooledLookup.of(nn.Linear(2, 2), FEATURES)
    with pytest.raises(ValueError, match="not the ops backend"):
        PooledLookup.of(sparsecore_ebc("table_wise", backend="xla"), SPARSE_ARCH_ORDER)
    mixed = ShardedSparseCoreEBC.from_torchrec(
        EmbeddingBagCollection(tables=[CONFIGS[0], EmbeddingBagConfig(
            num_embeddings=5, embedding_dim=4, name="t_narrow", feature_names=["narrow"])], device="cpu"),
        BATCH, {"t_user": TableSharding("table_wise", (0,)), "t_narrow": TableSharding("table_wise", (0,))},
        Adagrad(0.1), backend="ops")
    with pytest.raises(ValueError, match="needs one dim for all features"):
        PooledLookup.of(mixed, ["user", "narrow"])


def test_lookup_dense_step_and_update_are_one_program() -> None:
    ebc, dense = sparsecore_ebc("table_wise"), DenseLoss().to("tpu")
    lookup, step = fused_step(ebc, dense)
    x, kjt, y = batch(0)
    text = step.hlo_text(x, y, *lookup.step_inputs(ebc.prefetch(kjt).local))
    main = text[text.index("func.func public @main"):]
    main = main[:main.index("\n")]
    # the tables, Adagrad accumulators and the dense parameters are donated: updated in place
    assert main.count("tf.aliasing_output") == 2 * len(ebc._backend.plan.stacks) + 3
    assert text.count("func.func public") == 1
    assert "stablehlo.gather" in text and "stablehlo.scatter" in text  # lookup, fused update
    assert "stablehlo.dot_general" in text  # the dense step
