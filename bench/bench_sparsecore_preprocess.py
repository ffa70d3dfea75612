"""Host preprocessing throughput: sparsecore (vectorized numpy) vs jax-tpu-embedding's C++.

Same validated inputs and plan (row pointers checked equal once; the tests check every byte);
prints samples/s and the ratio. Ours starts from validated flat arrays, theirs from its ragged
object arrays (conversion not timed).
Timings on a shared 2-core box are noisy: read the ratio, not the absolute numbers.

    .venv/bin/python bench/bench_sparsecore_preprocess.py [--batch 4096] [--chips 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from tqdm import tqdm

from sparsecore.jte_interop import jte_feature_specs, jte_inputs, jte_preprocess_ragged
from sparsecore.preprocess import preprocess_inputs
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking
from sparsecore.validation import feature_inputs


def build(batch: int, chips: int, num_features: int, hot: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    vocabs = [int(v) for v in rng.choice([1000, 50_000, 1_000_000], size=num_features)]
    tables = [TableSpec(f"t{i}", v, 64, "sum" if i % 2 else "mean", max_ids_per_partition=512,
                        max_unique_ids_per_partition=512) for i, v in enumerate(vocabs)]
    features = [FeatureSpec(f"f{i}", f"t{i}", batch, weighted=i % 3 == 0) for i in range(num_features)]
    plan = plan_stacking(tables, features, SparseCoreTopology("v5p", chips)).with_table_limits()
    lengths = rng.integers(0, 2 * hot + 1, size=batch * num_features)
    per_feature = lengths.reshape(num_features, batch).sum(axis=1)
    # Zipf-like ids: heavy heads, so same-sample duplicates occur
    values = np.concatenate([np.minimum(rng.zipf(1.2, size=n) - 1, v - 1) for n, v in zip(per_feature, vocabs)])
    kjt = KeyedJaggedTensor(keys=[f.name for f in features], values=torch.from_numpy(values),
                            lengths=torch.from_numpy(lengths).int(),
                            weights=torch.from_numpy(rng.uniform(0.5, 1.5, size=values.size)).float())
    return plan, feature_inputs(kjt, plan.features, plan.tables), int(values.size)


def best_time(fn, repeats: int, label: str) -> float:
    times = []
    for _ in tqdm(range(repeats), desc=label, leave=False):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--chips", type=int, default=4)
    parser.add_argument("--features", type=int, default=26)
    parser.add_argument("--hot", type=int, default=4, help="mean ids per sample per feature")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    plan, inputs, ids = build(args.batch, args.chips, args.features, args.hot)
    ours = preprocess_inputs(inputs, plan)
    ragged, specs = jte_inputs(inputs, plan), jte_feature_specs(plan)
    theirs, _ = jte_preprocess_ragged(*ragged, specs, plan)
    for name, csr in ours.stacks.items():  # same bytes where the C++ writes (see tests for the full check)
        assert np.array_equal(csr.row_pointers, np.asarray(theirs.sparse_dense_matmul_input.lhs_row_pointers[name]))
    t_ours = best_time(lambda: preprocess_inputs(inputs, plan), args.repeats, "sparsecore")
    t_jte = best_time(lambda: jte_preprocess_ragged(*ragged, specs, plan), args.repeats, "jax-tpu-embedding")
    print(f"batch {args.batch} x {args.features} features, {ids} ids, v5p x {args.chips} "
          f"({plan.topology.num_sparsecores} SparseCores), {len(plan.stacks)} stacks; best of {args.repeats}")
    print(f"sparsecore (numpy)      : {args.batch / t_ours:12,.0f} samples/s  {ids / t_ours:14,.0f} ids/s")
    print(f"jax-tpu-embedding (C++) : {args.batch / t_jte:12,.0f} samples/s  {ids / t_jte:14,.0f} ids/s"
          "  (inputs pre-converted to its ragged format, not timed)")
    print(f"ratio sparsecore / jax-tpu-embedding: {t_jte / t_ours:.2f}x")


if __name__ == "__main__":
    main()
