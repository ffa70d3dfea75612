"""Lookup forward + backward + fused update throughput: each runnable sparsecore backend vs
FBGEMM's TBE used directly on the same tables and inputs (Adagrad, weighted multi-hot).

The ``xla`` step includes host preprocessing (KJT -> CSR) and the jit-compiled JAX kernels;
``fbgemm`` is our wrapper over the same FBGEMM kernels the reference calls directly. Timings on
a shared 2-core box are noisy: read the ratios.

    .venv/bin/python bench/bench_sparsecore_lookup.py [--batch 2048] [--tables 8] [--steps 10]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import quiet_box
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    EmbeddingLocation,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from tqdm import tqdm

from sparsecore.backends import make_backend
from sparsecore.optimizers import Adagrad
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking
from sparsecore.validation import feature_inputs


def batches(plan, steps: int, hot: int, seed: int = 0) -> list[KeyedJaggedTensor]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        lengths = rng.integers(0, 2 * hot + 1, size=sum(f.batch_size for f in plan.features))
        values = np.concatenate([
            rng.integers(0, plan.tables[f.table].vocab_size, size=int(n.sum()))
            for f, n in zip(plan.features, np.split(lengths, len(plan.features)))])
        out.append(KeyedJaggedTensor(keys=[f.name for f in plan.features], values=torch.from_numpy(values),
                                     lengths=torch.from_numpy(lengths).int(),
                                     weights=torch.from_numpy(rng.uniform(0.5, 1.5, values.size)).float()))
    return out


def time_backend(name: str, plan, kjts, grads) -> float:
    backend = make_backend(name, plan, seed=0)
    warm = feature_inputs(kjts[0], plan.features, plan.tables)
    _, context = backend.forward(warm)  # compile / warm up
    backend.backward(context, grads)
    start = time.perf_counter()
    for kjt in tqdm(kjts, desc=name, leave=False):
        _, context = backend.forward(feature_inputs(kjt, plan.features, plan.tables))
        backend.backward(context, grads)
    return (time.perf_counter() - start) / len(kjts)


def time_direct_tbe(plan, kjts, grad: torch.Tensor, learning_rate: float) -> float:
    specs = [(t.vocab_size, t.dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for t in plan.tables.values()]
    tbe = SplitTableBatchedEmbeddingBagsCodegen(specs, optimizer=EmbOptimType.EXACT_ADAGRAD,
                                                learning_rate=learning_rate, pooling_mode=PoolingMode.SUM)

    def step(kjt):
        tbe(kjt.values(), kjt.offsets(), per_sample_weights=kjt.weights()).backward(grad)

    step(kjts[0])
    start = time.perf_counter()
    for kjt in tqdm(kjts, desc="tbe", leave=False):
        step(kjt)
    return (time.perf_counter() - start) / len(kjts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hot", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    optimizer = Adagrad(0.05, initial_accumulator_value=0.0, eps=1e-8)
    tables = [TableSpec(f"t{i}", args.vocab, args.dim, "sum", optimizer, max_ids_per_partition=1024,
                        max_unique_ids_per_partition=1024) for i in range(args.tables)]
    features = [FeatureSpec(f"f{i}", f"t{i}", args.batch, weighted=True) for i in range(args.tables)]
    plan = plan_stacking(tables, features, SparseCoreTopology("v5p", 1), stack_tables=False)
    kjts = batches(plan, args.steps, args.hot)
    grads = {f.name: torch.ones(args.batch, args.dim) for f in features}
    t_ref = time_direct_tbe(plan, kjts, torch.ones(args.batch, args.dim * args.tables), optimizer.learning_rate)
    ids = sum(int(k.values().numel()) for k in kjts) / len(kjts)
    print(f"{args.tables} tables x {args.vocab} x {args.dim}, batch {args.batch}, ~{ids:,.0f} ids/step, "
          f"Adagrad, {args.steps} steps (v5p x 1 layout for xla)")
    print(f"{'FBGEMM TBE (direct)':22s}: {args.batch / t_ref:10,.0f} samples/s  ratio 1.00")
    for name in ("fbgemm", "xla"):
        t = time_backend(name, plan, kjts, grads)
        print(f"{'sparsecore ' + name:22s}: {args.batch / t:10,.0f} samples/s  ratio {t_ref / t:.2f}")


if __name__ == "__main__":
    quiet_box.run(main)
