"""Stock TorchRec reference: an unsharded EmbeddingBagCollection trained with a dense torch
optimizer on its weights (dense SGD/Adagrad leave untouched rows unchanged, like a fused update)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from torchrec.optim import RowWiseAdagrad as TorchrecRowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore import SGD, Adagrad, RowWiseAdagrad

CONFIGS = [
    EmbeddingBagConfig(num_embeddings=40, embedding_dim=8, name="t_user", feature_names=["user"],
                       pooling=PoolingType.SUM),
    EmbeddingBagConfig(num_embeddings=30, embedding_dim=16, name="t_item", feature_names=["item", "hist"],
                       pooling=PoolingType.MEAN),
    EmbeddingBagConfig(num_embeddings=9, embedding_dim=8, name="t_small", feature_names=["small"],
                       pooling=PoolingType.SUM),
]
FEATURES = ["user", "item", "hist", "small"]

# sparsecore optimizer spec -> the same update as a dense torch optimizer
OPTIMIZERS = {
    "sgd": (SGD(0.3), lambda p: torch.optim.SGD(p, lr=0.3)),
    "adagrad": (Adagrad(0.2, initial_accumulator_value=0.1, eps=1e-10),
                lambda p: torch.optim.Adagrad(p, lr=0.2, initial_accumulator_value=0.1, eps=1e-10)),
    "rowwise_adagrad": (RowWiseAdagrad(0.2, initial_accumulator_value=0.0, eps=1e-10),
                        lambda p: TorchrecRowWiseAdagrad(p, lr=0.2, eps=1e-10)),
}


def reference_ebc(seed: int = 0, sum_pooled: bool = False) -> EmbeddingBagCollection:
    """The reference tables (``sum_pooled``: every one sum-pooled, the mean table's too)."""
    torch.manual_seed(seed)
    configs = [dataclasses.replace(c, pooling=PoolingType.SUM) for c in CONFIGS] if sum_pooled else CONFIGS
    return EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))


def random_kjt(batch: int, seed: int, max_hot: int = 4) -> KeyedJaggedTensor:
    """Multi-hot ids over small ranges (many duplicates, some empty samples)."""
    rng = np.random.default_rng(seed)
    vocab = {"user": 40, "item": 30, "hist": 30, "small": 9}
    lengths = rng.integers(0, max_hot + 1, size=(len(FEATURES), batch))
    values = np.concatenate([rng.integers(0, vocab[f], size=int(lengths[i].sum())) for i, f in enumerate(FEATURES)])
    return KeyedJaggedTensor(keys=FEATURES, values=torch.from_numpy(values),
                             lengths=torch.from_numpy(lengths.reshape(-1)))


def targets(batch: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, 48, generator=torch.Generator().manual_seed(1000 + seed))


def slice_batch(kjt: KeyedJaggedTensor, start: int, stop: int) -> KeyedJaggedTensor:
    """Samples [start, stop) of every feature (a rank's part of the global batch)."""
    per_key = kjt.to_dict()
    values, lengths = [], []
    for key in kjt.keys():
        jt = per_key[key]
        offsets = jt.offsets()
        values.append(jt.values()[offsets[start]:offsets[stop]])
        lengths.append(jt.lengths()[start:stop])
    return KeyedJaggedTensor(keys=kjt.keys(), values=torch.cat(values), lengths=torch.cat(lengths))


def with_last_id(kjt: KeyedJaggedTensor, value: int) -> KeyedJaggedTensor:
    """``kjt`` with its last id (one of its last feature's) replaced by ``value``."""
    values = kjt.values().clone()
    values[-1] = value
    return KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths())


def assert_tables_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, weight in actual.items():
        torch.testing.assert_close(weight, expected[name], atol=1e-5, rtol=1e-5)


def train_reference(optimizer: str, steps: int, batch: int, column_blocks: Mapping[str, int] | None = None,
                    ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Outputs of each step and the final weights of stock TorchRec (loss: 0.5 * |out - target|^2).
    ``column_blocks``: tables trained as that many column blocks, each a parameter of its own (the
    optimizer state TorchRec's column-wise sharding keeps: row-wise state per block)."""
    ebc = reference_ebc()
    blocks = {name: [torch.nn.Parameter(block.clone()) for block in
                     bag.weight.detach().chunk((column_blocks or {}).get(name, 1), dim=1)]
              for name, bag in ebc.embedding_bags.items()}
    opt = OPTIMIZERS[optimizer][1]([p for parts in blocks.values() for p in parts])

    def weights() -> dict[str, torch.Tensor]:
        return {name: torch.cat(parts, dim=1) for name, parts in blocks.items()}

    outputs = []
    for step in range(steps):
        tables = {f"embedding_bags.{name}.weight": weight for name, weight in weights().items()}
        out = torch.func.functional_call(ebc, tables, (random_kjt(batch, step),)).values()
        outputs.append(out.detach().clone())
        opt.zero_grad()
        (0.5 * ((out - targets(batch, step)) ** 2).sum()).backward()
        opt.step()
    return outputs, {name: weight.detach().clone() for name, weight in weights().items()}
