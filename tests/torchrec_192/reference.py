"""Shared pieces of the TorchRec 1.9.2 TPU-module tests: tables, batches, the stock CPU TorchRec
reference with TorchRec TPU's optimizer semantics, and moving logical tables into and out of a
``SparseCoreFused*Collection`` with TorchRec's own ``checkpoint.utils`` (MOD sharding).

TorchRec TPU's fused optimizers, as its module calls the SparseCore ops: SGD and Adagrad update like
``torch.optim.SGD`` / ``torch.optim.Adagrad`` on the rows a batch touches (a row's gradient
is dense-zero elsewhere, so these equal torch.optim's); Adam passes the raw ``lr`` as the op's
``alpha_t`` (no bias correction), ``eps`` defaulting to 1e-10, and is lazy (untouched rows and their
moments stay): :class:`LazyAdamWithoutBiasCorrection` is that rule on the stock module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torchrec.experimental.torch_tpu.checkpoint.utils import (
    stack_and_shard_global_tensor,
    unstack_and_unshard_global_tensor,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

NUM_SC = 2
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1, "eps": 1e-10}),
    "adam": (torch.optim.Adam, {"lr": 0.05, "betas": (0.9, 0.99), "eps": 1e-8}),
}


def bag_configs() -> list[EmbeddingBagConfig]:
    """"ta" (two features) and "tc" share a dim; "tb" is MEAN-pooled with another dim."""
    return [
        EmbeddingBagConfig(name="ta", num_embeddings=100, embedding_dim=8, feature_names=["fa", "fa2"]),
        EmbeddingBagConfig(name="tb", num_embeddings=40, embedding_dim=16, feature_names=["fb"],
                           pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="tc", num_embeddings=60, embedding_dim=8, feature_names=["fc"]),
    ]


def seq_configs() -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(name="sa", num_embeddings=80, embedding_dim=8, feature_names=["ha", "ha2"]),
        EmbeddingConfig(name="sb", num_embeddings=30, embedding_dim=8, feature_names=["hb"]),
    ]


def sc_tables(configs: list[Any], stack: dict[str, str] | None = None, max_seq_len: int | None = None) -> list[Any]:
    """The configs wrapped in ``SparseCoreEmbeddingConfig`` (``stack``: table -> stack name)."""
    from torchrec.experimental.torch_tpu import SparseCoreEmbeddingConfig

    stack = stack or {}
    return [SparseCoreEmbeddingConfig(config=c, stack_table_name=stack.get(c.name), max_seq_len=max_seq_len)
            for c in configs]


def ids_per_sample(configs: list[Any], samples: int, seed: int, max_len: int = 3) -> dict[str, list[torch.Tensor]]:
    """Per feature, each sample's ids (0 to ``max_len`` of them, repeats within and across samples)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for c in configs:
        for f in c.feature_names:
            out[f] = [torch.randint(0, min(c.num_embeddings, 20), (int(torch.randint(0, max_len + 1, (1,),
                                                                                     generator=g)),), generator=g)
                      for _ in range(samples)]
    return out


def kjt(ids: dict[str, list[torch.Tensor]], lo: int = 0, hi: int | None = None) -> KeyedJaggedTensor:
    """The KJT of samples ``lo:hi`` of ``ids``."""
    keys = list(ids)
    rows = [x for k in keys for x in ids[k][lo:hi]]
    return KeyedJaggedTensor(keys=keys, values=torch.cat(rows).long() if rows else torch.zeros(0, dtype=torch.long),
                             lengths=torch.tensor([len(x) for x in rows], dtype=torch.long))


def touched_rows(ids: dict[str, list[torch.Tensor]], configs: list[Any]) -> dict[str, torch.Tensor]:
    """Per table, the rows the batch looks up."""
    out = {}
    for c in configs:
        found = [x for f in c.feature_names for x in ids[f]]
        out[c.name] = torch.unique(torch.cat(found)) if found else torch.zeros(0, dtype=torch.long)
    return out


def _num_shards(module: Any) -> int:
    return module._global_device_count * module._num_sc_per_device


def load_logical_tables(module: Any, weights: dict[str, torch.Tensor]) -> None:
    """Put logical tables into a fused module's stacked MOD-sharded weights (this rank's block)."""
    for config in module.stacked_configs:
        full = stack_and_shard_global_tensor(weights, config, _num_shards(module))
        param = module.table_weights[config.stack_name]
        with torch.no_grad():
            if isinstance(param, DTensor):
                local = param.to_local()
                rank = param.device_mesh.get_local_rank()
                local.copy_(full[rank * local.shape[0]:(rank + 1) * local.shape[0]].to(local.device))
            else:
                param.copy_(full.to(param.device))


def logical_tables(module: Any, stacked: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A fused module's logical tables (or of ``stacked``: its slots, by stack name), on CPU."""
    out = {}
    for config in module.stacked_configs:
        value = (stacked or module.table_weights)[config.stack_name].detach()
        full = value.full_tensor() if isinstance(value, DTensor) else value
        out.update(unstack_and_unshard_global_tensor(full.cpu(), config, _num_shards(module)))
    return out


class LazyAdamWithoutBiasCorrection:
    """TorchRec TPU's fused Adam on a stock module's parameters: per touched row,
    m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2, w -= lr m / (sqrt(v) + eps)."""

    def __init__(self, weights: dict[str, torch.nn.Parameter], lr: float, betas: tuple[float, float],
                 eps: float = 1e-10) -> None:
        self.weights, self.lr, self.betas, self.eps = weights, lr, betas, eps
        self.state = {n: (torch.zeros_like(w), torch.zeros_like(w)) for n, w in weights.items()}

    def zero_grad(self) -> None:
        for w in self.weights.values():
            w.grad = None

    def step(self, touched: dict[str, torch.Tensor]) -> None:
        b1, b2 = self.betas
        with torch.no_grad():
            for name, w in self.weights.items():
                rows = touched[name]
                m, v = self.state[name]
                g = w.grad[rows] if w.grad is not None else torch.zeros_like(w[rows])
                m[rows] = b1 * m[rows] + (1 - b1) * g
                v[rows] = b2 * v[rows] + (1 - b2) * g * g
                w[rows] -= self.lr * m[rows] / (v[rows].sqrt() + self.eps)


class StockReference:
    """A stock CPU TorchRec collection with TorchRec TPU's optimizer semantics."""

    def __init__(self, stock: torch.nn.Module, optimizer: str) -> None:
        self.stock = stock
        self.weights = {n: m.weight for n, m in (getattr(stock, "embedding_bags", None) or stock.embeddings).items()}
        optimizer_type, kwargs = OPTIMIZERS[optimizer]
        if optimizer == "adam":
            self.optimizer: Any = LazyAdamWithoutBiasCorrection(self.weights, kwargs["lr"], kwargs["betas"],
                                                                kwargs["eps"])
        else:
            self.optimizer = optimizer_type(stock.parameters(), **kwargs)

    def step(self, loss: torch.Tensor, touched: dict[str, torch.Tensor]) -> None:
        self.optimizer.zero_grad()
        loss.backward()
        if isinstance(self.optimizer, LazyAdamWithoutBiasCorrection):
            self.optimizer.step(touched)
        else:
            self.optimizer.step()
