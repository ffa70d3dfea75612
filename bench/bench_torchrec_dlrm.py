"""Training throughput of stock TorchRec DLRM on CPU: the reference later paths are compared to.

Setup (the defaults): 26 tables x 100k rows x dim 64, one id per feature, batch 2048, dense arch
512-256-64, over arch 512-512-256-1, fused Adagrad on the tables (FBGEMM TBE inside backward)
through DistributedModelParallel on a gloo world of 1, Adagrad on the MLPs. Batches come from
TorchRec's own ``RandomRecDataset`` (uniform ids), generated before timing, so the number is the
model step alone (forward, backward, fused and dense updates), not the input pipeline.

Other benchmarks (SparseCore / TPU device) import :func:`reference_spec`, :func:`random_batches`,
:func:`samples_per_sec` and :func:`measure_torchrec` and print their ratio against it, measured in
the same run. Timings on a shared 2-core box are noisy.

    .venv/bin/python bench/bench_torchrec_dlrm.py [--steps 20] [--warmup 3] [--batch-size 2048]
"""

from __future__ import annotations

import argparse
import itertools
import time
from typing import Callable, Sequence

import quiet_box
import torch
from torchrec.datasets.random import RandomRecDataset
from torchrec.datasets.utils import Batch
from tqdm import tqdm

from torchrec_tpu.train.config import OptimConfig
from torchrec_tpu.train.distributed import process_group
from torchrec_tpu.train.engines.torchrec_engine import build_optimizer, shard_model
from torchrec_tpu.train.loop import train_step
from torchrec_tpu.train.model import ModelSpec, build_dlrm

NUM_TABLES = 26
NUM_DENSE = 13
LEARNING_RATE = 0.01
OPTIM = OptimConfig(sparse_optimizer="adagrad", sparse_lr=LEARNING_RATE, dense_optimizer="adagrad",
                    dense_lr=LEARNING_RATE)


def reference_spec(num_embeddings: int = 100_000, embedding_dim: int = 64) -> ModelSpec:
    """26 equal tables, dense 512-256-<dim>, over 512-512-256-1."""
    return ModelSpec(
        feature_names=tuple(f"C{i}" for i in range(1, NUM_TABLES + 1)),
        table_sizes=(num_embeddings,) * NUM_TABLES,
        embedding_dim=embedding_dim,
        dense_in_features=NUM_DENSE,
        dense_layers=(512, 256, embedding_dim),
        over_layers=(512, 512, 256, 1),
    )


def random_batches(spec: ModelSpec, batch_size: int, count: int, seed: int = 0) -> list[Batch]:
    """``count`` distinct single-hot batches with uniform ids, from TorchRec's generator."""
    dataset = RandomRecDataset(
        keys=list(spec.feature_names), batch_size=batch_size, hash_sizes=list(spec.table_sizes),
        ids_per_feature=1, num_dense=spec.dense_in_features, manual_seed=seed,
        num_batches=count, num_generated_batches=count,
    )
    return list(dataset)


def samples_per_sec(
    step: Callable[[Batch], object], batches: Sequence[Batch], warmup: int, steps: int, desc: str,
    finish: Callable[[], object] = lambda: None,
) -> float:
    """Run ``warmup`` untimed then ``steps`` timed steps, cycling over ``batches``; ``finish`` waits
    for steps still running (a device's asynchronous dispatch) at the end of each phase."""
    stream = itertools.cycle(batches)
    for batch in itertools.islice(stream, warmup):
        step(batch)
    finish()
    timed = list(itertools.islice(stream, steps))
    start = time.perf_counter()
    for batch in tqdm(timed, desc=desc, unit="step", leave=False):
        step(batch)
    finish()
    elapsed = time.perf_counter() - start
    return sum(b.labels.numel() for b in timed) / elapsed


def measure_torchrec(
    spec: ModelSpec, batch_size: int, warmup: int, steps: int, batches: Sequence[Batch]
) -> float:
    """samples/s of the stock TorchRec DMP training step on CPU over ``batches``."""
    device = torch.device("cpu")
    with process_group() as env:
        model = shard_model(build_dlrm(spec, dense_device=device), env, device, OPTIM, batch_size)
        optimizer = build_optimizer(model, OPTIM)
        model.train()
        return samples_per_sec(lambda b: train_step(model, optimizer, b), batches, warmup, steps,
                               desc="torchrec DMP")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default: 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: 3)")
    parser.add_argument("--batch-size", type=int, default=2048, help="default: 2048")
    parser.add_argument("--num-embeddings", type=int, default=100_000, help="rows per table")
    parser.add_argument("--embedding-dim", type=int, default=64, help="default: 64")
    parser.add_argument("--distinct-batches", type=int, default=4,
                        help="distinct random batches cycled over (default: 4)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (default 0: torch's default, one per core)")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "num_embeddings", "embedding_dim", "distinct_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.threads < 0:
        parser.error(f"--warmup and --threads must be >= 0, got {args.warmup}, {args.threads}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = reference_spec(args.num_embeddings, args.embedding_dim)
    batches = random_batches(spec, args.batch_size, args.distinct_batches)
    rate = measure_torchrec(spec, args.batch_size, args.warmup, args.steps, batches)
    print(
        f"torchrec DLRM train, CPU, DMP world 1, fused Adagrad: {NUM_TABLES} tables x "
        f"{args.num_embeddings} x {args.embedding_dim}, batch {args.batch_size}, "
        f"{torch.get_num_threads()} thread(s)\n"
        f"  {rate:,.0f} samples/s ({1e3 * args.batch_size / rate:.1f} ms/step, "
        f"{args.steps} timed steps after {args.warmup} warmup; shared box, noisy)"
    )


if __name__ == "__main__":
    quiet_box.run(main)
