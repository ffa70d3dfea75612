"""Sequence-embedding training step (forward, backward, optimizer): the sharded sparsecore
EmbeddingCollection (1 rank; ``fbgemm`` and ``xla`` backends, fused Adagrad) vs stock TorchRec's
EmbeddingCollection with sparse gradients and torch's Adagrad, on the same tables and inputs.

Timings on a shared 2-core box are noisy: read the ratios.

    .venv/bin/python bench/bench_sharded_ec.py [--batch 512] [--tables 4] [--rows 100000] [--steps 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import quiet_box
import torch
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore import Adagrad
from torchrec_tpu.sharding import ShardedSparseCoreEC, TableSharding

LR = 0.05


def kjts(features: list[str], rows: int, batch: int, hot: int, steps: int) -> list[KeyedJaggedTensor]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        lengths = rng.integers(0, 2 * hot + 1, size=len(features) * batch)
        values = rng.zipf(1.2, size=int(lengths.sum())) % rows  # skewed ids, as real traffic
        out.append(KeyedJaggedTensor(keys=features, values=torch.from_numpy(values),
                                     lengths=torch.from_numpy(lengths)))
    return out


def time_steps(step: Callable[[KeyedJaggedTensor], None], batches: list[KeyedJaggedTensor]) -> float:
    step(batches[0])  # compile / warm up
    start = time.perf_counter()
    for kjt in batches:
        step(kjt)
    return (time.perf_counter() - start) / len(batches)


def loss(out: dict) -> torch.Tensor:
    return sum((jt.values() ** 2).sum() for jt in out.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hot", type=int, default=8, help="mean ids per sample")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the box is shared)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    configs = [EmbeddingConfig(name=f"t{i}", num_embeddings=args.rows, embedding_dim=args.dim,
                               feature_names=[f"f{i}"]) for i in range(args.tables)]
    stock = EmbeddingCollection(tables=configs, device=torch.device("cpu"))
    batches = kjts([f"f{i}" for i in range(args.tables)], args.rows, args.batch, args.hot, args.steps + 1)

    for emb in stock.embeddings.values():
        emb.sparse = True
    optimizer = torch.optim.Adagrad(list(stock.parameters()), lr=LR)

    def stock_step(kjt: KeyedJaggedTensor) -> None:
        optimizer.zero_grad()
        loss(stock(kjt)).backward()
        optimizer.step()

    reference = time_steps(stock_step, batches)
    print(f"stock TorchRec EC + sparse torch Adagrad: {reference * 1e3:8.1f} ms/step")
    plan = {c.name: TableSharding("table_wise", (0,)) for c in configs}
    for backend in ("fbgemm", "xla"):
        sharded = ShardedSparseCoreEC.from_torchrec(stock, plan, Adagrad(LR), batch_size=args.batch, backend=backend)
        seconds = time_steps(lambda kjt: loss(sharded(kjt)).backward(), batches)
        print(f"sharded sparsecore EC ({backend:6s}):          {seconds * 1e3:8.1f} ms/step  "
              f"({reference / seconds:.2f}x stock)")


if __name__ == "__main__":
    quiet_box.run(main)
