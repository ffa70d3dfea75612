"""Lookup forward + backward + fused update throughput: each runnable sparsecore backend vs
FBGEMM's TBE used directly on the same tables and inputs (Adagrad, weighted multi-hot).

The ``xla`` step includes host preprocessing (KJT -> CSR) and the jit-compiled JAX kernels;
``fbgemm`` is our wrapper over the same FBGEMM kernels the reference calls directly. Timings on
a shared 2-core box are noisy: read the ratios.

    .venv/bin/python bench/bench_sparsecore_lookup.py [--batch 2048] [--tables 8] [--steps 10]

``--skewed`` times an adversarial stream instead (issue 74's target): one hot id in 30% of table
0's samples and table 1's lengths bursting 10x every 4th batch. Per backend (xla, ops) it runs the
stream under ``overflow="minibatch"`` with the limits a stream without skew needs, and beside it
with limits large enough for the whole stream from the start; it prints the steady samples/s of
both, their ratio (target: minibatch within 15%), the ids dropped (target 0), the most minibatches
a batch needed and whether the two runs' tables are equal.
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
from sparsecore.minibatching import minibatch_entries
from sparsecore.optimizers import Adagrad
from sparsecore.preprocess import preprocess_inputs
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


def skewed_batches(plan, steps: int, hot: int, seed: int = 0, burst_every: int = 4) -> list[KeyedJaggedTensor]:
    """:func:`batches` made adversarial: row 0 of table 0 in 30% of its samples, and table 1's
    lengths 10x in every ``burst_every``-th batch."""
    rng = np.random.default_rng(seed + 1)
    out = []
    for step, kjt in enumerate(batches(plan, steps, hot, seed)):
        lengths, values = kjt.lengths().numpy().copy(), kjt.values().numpy().copy()
        samples = plan.features[0].batch_size
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        hit = np.flatnonzero((rng.random(samples) < 0.3) & (lengths[:samples] > 0))
        values[starts[hit]] = 0
        if step % burst_every == burst_every - 1:
            second = slice(samples, samples + plan.features[1].batch_size)
            lengths[second] *= 10
            per_feature = np.split(values, np.cumsum([int(n.sum()) for n in np.split(kjt.lengths().numpy(),
                                                                                      len(plan.features))])[:-1])
            per_feature[1] = rng.integers(0, plan.tables[plan.features[1].table].vocab_size, int(lengths[second].sum()))
            values = np.concatenate(per_feature)
        out.append(KeyedJaggedTensor(keys=kjt.keys(), values=torch.from_numpy(values),
                                     lengths=torch.from_numpy(lengths).int(),
                                     weights=torch.from_numpy(rng.uniform(0.5, 1.5, values.size)).float()))
    return out


def demand(plan, kjts) -> list[int]:
    """Per batch, the most ids or unique ids any partition of any stack gets (measured before any
    drop, so the plan's own limits do not matter)."""
    most = []
    for kjt in kjts:
        stats = preprocess_inputs(feature_inputs(kjt, plan.features, plan.tables), plan, overflow="drop").stats
        most.append(max(int(max(s.max_ids_per_partition.max(), s.max_unique_ids_per_partition.max()))
                        for s in stats.values()))
    return most


def run_stream(name: str, plan, kjts, grads, warmup: int, overflow: str) -> tuple[float, int, dict]:
    """(seconds per batch over ``kjts[warmup:]``, ids dropped, final tables) of backend ``name``,
    after a warm-up pass over the whole stream: steady state, every program a batch of it needs
    compiled (a step's shapes follow its batch: the minibatch slots, the bucketed sizes)."""
    backend = make_backend(name, plan, seed=0, overflow=overflow)
    dropped = 0

    def step(kjt):
        nonlocal dropped
        _, context = backend.forward(feature_inputs(kjt, plan.features, plan.tables))
        backend.backward(context, grads)
        dropped += sum(s.dropped_ids for s in backend.last_stats.values())

    for kjt in tqdm(kjts, desc=f"{name} {overflow} warm-up", leave=False):
        step(kjt)
    start = time.perf_counter()
    for kjt in tqdm(kjts[warmup:], desc=f"{name} {overflow}", leave=False):
        step(kjt)
    return (time.perf_counter() - start) / (len(kjts) - warmup), dropped, backend.table_weights()


def skewed_main(args: argparse.Namespace, optimizer) -> None:
    """The ``--skewed`` comparison (module docstring)."""
    import torchrec_tpu.sharding  # noqa: F401  (registers the ops backend)

    def plan_with(limit: int):
        tables = [TableSpec(f"t{i}", args.vocab, args.dim, "sum", optimizer, max_ids_per_partition=limit,
                            max_unique_ids_per_partition=limit) for i in range(args.tables)]
        features = [FeatureSpec(f"f{i}", f"t{i}", args.batch, weighted=True) for i in range(args.tables)]
        return plan_stacking(tables, features, SparseCoreTopology("v5p", 1), stack_tables=False)

    probe = plan_with(8)
    kjts = skewed_batches(probe, args.warmup + args.steps, args.hot)
    calm = demand(probe, batches(probe, 4, args.hot, seed=99))  # the same stream without skew
    small, large = (-(-value // 8) * 8 for value in (max(calm), max(demand(probe, kjts))))
    small_plan, large_plan = plan_with(small), plan_with(large)
    inputs = [feature_inputs(k, small_plan.features, small_plan.tables) for k in kjts]
    k_most = max(minibatch_entries(st, x, 1, 4).num_minibatches for x in inputs for st in small_plan.stacks)
    grads = {f.name: torch.ones(args.batch, args.dim) for f in small_plan.features}
    print(f"skewed stream: {args.tables} tables x {args.vocab} x {args.dim}, batch {args.batch}, row 0 of t0 in 30% "
          f"of its samples, t1's lengths x10 every 4th batch; {args.warmup} + {args.steps} batches, the last "
          f"{args.steps} timed after a warm-up pass over all")
    print(f"limits: minibatch run {small} (what the stream without skew needs), reference {large} (the stream's "
          f"most); up to {k_most} minibatches a batch")
    for name in args.backends.split(","):
        t_mb, dropped, tables_mb = run_stream(name, small_plan, kjts, grads, args.warmup, "minibatch")
        t_ref, dropped_ref, tables_ref = run_stream(name, large_plan, kjts, grads, args.warmup, "error")
        diff = max(float((tables_mb[t] - tables_ref[t]).abs().max()) for t in tables_ref)
        equal = all(torch.equal(tables_mb[t], tables_ref[t]) for t in tables_ref)
        print(f"{name:4s} minibatch {args.batch / t_mb:10,.0f} samples/s, large limits {args.batch / t_ref:10,.0f} "
              f"samples/s: ratio {t_ref / t_mb:.2f} (target >= 0.85); ids dropped {dropped + dropped_ref} (target 0); "
              f"tables {'bit-equal' if equal else f'differ by up to {diff:.2e}'}")


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
    parser.add_argument("--skewed", action="store_true", help="time the adversarial skewed stream (module docstring)")
    parser.add_argument("--warmup", type=int, default=8, help="--skewed: batches of the stream before the timed ones "
                        "(after a warm-up pass over all of it)")
    parser.add_argument("--backends", default="xla,ops", help="--skewed: the backends compared, comma-separated")
    args = parser.parse_args()
    optimizer = Adagrad(0.05, initial_accumulator_value=0.0, eps=1e-8)
    if args.skewed:
        skewed_main(args, optimizer)
        return
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
