"""Host preprocessing throughput: sparsecore (compiled C++ and numpy) vs jax-tpu-embedding's C++.

Same validated inputs and plan in one process (outputs checked equal once; the tests check every
byte); prints samples/s, ids/s and the ratio, on all CPUs and with the whole process pinned to one
CPU (single thread: ours with threads=1, jax-tpu-embedding's pool on that one CPU). The runs of
the engines alternate, best of ``--repeats`` each. Ours starts from validated flat arrays, theirs
from its ragged object arrays (conversion not timed). Without --batch/--chips it runs the default
config (batch 4096 x 26 features, v5p x 4 chips) and batch 65536 on v5p-16 (8 chips), whose
partition limits are set from one measured batch (FDO, no headroom) so that nothing is dropped.
Timings on a shared 2-core box are noisy: read the ratios, not the absolute numbers.

    .venv/bin/python bench/bench_sparsecore_preprocess.py [--batch 4096 --chips 4] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import quiet_box
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sparsecore.jte_interop import jte_feature_specs, jte_inputs, jte_preprocess_ragged
from sparsecore.limits import FdoRecorder
from sparsecore.preprocess import preprocess_inputs, preprocess_row_ordered
from sparsecore.specs import FeatureSpec, SparseCoreTopology, TableSpec
from sparsecore.stacking import plan_stacking
from sparsecore.validation import feature_inputs

CONFIGS = ((4096, 4), (65536, 8))  # (batch, v5p chips): the default config and v5p-16


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
    inputs = feature_inputs(kjt, plan.features, plan.tables)
    recorder = FdoRecorder()
    recorder.record(preprocess_inputs(inputs, plan, overflow="drop").stats)
    if any(s.dropped_ids for s in recorder.stats.values()):  # the table limits are too small for this batch
        plan = plan.with_limits(recorder.propose(headroom=1.0))
    return plan, inputs, int(values.size)


def best_times(fns: dict, repeats: int) -> dict[str, float]:
    """Best wall time of each function, the functions run in turn ``repeats`` times."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def pin_process(cpus: set[int]) -> None:
    """Every thread of this process (jax-tpu-embedding's pool included) onto ``cpus``."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # the thread ended meanwhile
            pass


def run(batch: int, chips: int, features: int, hot: int, repeats: int, with_numpy: bool) -> None:
    plan, inputs, ids = build(batch, chips, features, hot)
    ragged, specs = jte_inputs(inputs, plan), jte_feature_specs(plan)
    ours = preprocess_inputs(inputs, plan, engine="compiled")
    theirs, _ = jte_preprocess_ragged(*ragged, specs, plan)
    for name, csr in ours.stacks.items():  # same bytes where the C++ writes (see tests for the full check)
        assert np.array_equal(csr.row_pointers, np.asarray(theirs.sparse_dense_matmul_input.lhs_row_pointers[name]))
    print(f"\nbatch {batch} x {features} features, {ids:,} ids, v5p x {chips} ({plan.topology.num_sparsecores} "
          f"SparseCores), {len(plan.stacks)} stacks, max_ids_per_partition "
          f"{sorted({s.max_ids_per_partition for s in plan.stacks})}; best of {repeats}")
    all_cpus = os.sched_getaffinity(0)
    for label, cpus, threads in ((f"{len(all_cpus)} CPUs", all_cpus, None), ("1 CPU ", {min(all_cpus)}, 1)):
        pin_process(cpus)
        fns = {
            "sparsecore compiled (CSR)        ": lambda: preprocess_inputs(inputs, plan, engine="compiled",
                                                                           threads=threads),
            "sparsecore compiled (row order)  ": lambda: preprocess_row_ordered(inputs, plan, engine="compiled",
                                                                                threads=threads),
            "jax-tpu-embedding C++            ": lambda: jte_preprocess_ragged(*ragged, specs, plan),
        }
        if with_numpy:
            fns["sparsecore numpy (CSR)           "] = lambda: preprocess_inputs(inputs, plan, engine="numpy",
                                                                              threads=threads)
        best = best_times(fns, repeats)
        t_jte = best["jax-tpu-embedding C++            "]
        for name, t in best.items():
            print(f"  [{label}] {name}: {batch / t:12,.0f} samples/s {ids / t:14,.0f} ids/s   {t_jte / t:5.2f}x jte")
    pin_process(all_cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, help="one config: this batch (with --chips)")
    parser.add_argument("--chips", type=int, default=4)
    parser.add_argument("--features", type=int, default=26)
    parser.add_argument("--hot", type=int, default=4, help="mean ids per sample per feature")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-numpy", action="store_true", help="skip the (slow) numpy reference")
    args = parser.parse_args()
    configs = [(args.batch, args.chips)] if args.batch else CONFIGS
    for batch, chips in configs:
        run(batch, chips, args.features, args.hot, args.repeats, with_numpy=not args.no_numpy)
    print("\n(jax-tpu-embedding's inputs pre-converted to its ragged format, not timed; x = its time / ours)")


if __name__ == "__main__":
    quiet_box.run(main)
