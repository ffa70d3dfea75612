"""Planner speed and plan quality, against TorchRec's planner measured in the same run.

1. Our search on 1000 tables x {64, 256} chips: wall time and the slowest device's estimated step
   time over the perfect-balance lower bound.
2. Head to head on a size TorchRec finishes quickly (default 60 tables x 8 devices, v5p-16):
   TorchRec's EmbeddingShardingPlanner (its enumerator, proposers and greedy partitioner, driven
   by our SparseCore estimator through the "mtia" proxy) vs our search, both plans scored by the
   same TPU cost model. Ratios > 1 favour ours. Timings on a shared 2-core box are noisy.

    .venv/bin/python bench/bench_planner.py [--tables 60] [--topology v5p-16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import logging
import random
import time
import warnings

import quiet_box

from torchrec_tpu.planner.partitioner import Partitioner
from torchrec_tpu.planner.tables import EmbeddingTable
from torchrec_tpu.topology import parse_accelerator_type


def synthetic_tables(n: int, seed: int = 0) -> list[EmbeddingTable]:
    """A production-like mix: vocabularies 1e3..4e6, dims 16..256, pooling 1..50, three optimizers."""
    rng = random.Random(seed)
    return [EmbeddingTable(f"t{i:04d}", rng.choice([1000, 10**4, 10**5, 10**6, 4 * 10**6]),
                           rng.choice([16, 32, 64, 128, 256]), rng.choice([1.0, 2.0, 5.0, 20.0, 50.0]),
                           rng.choice(["sgd", "adagrad", "rowwise_adagrad"])) for i in range(n)]


def _timed(fn, repeats: int):
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def bench_scale(repeats: int) -> None:
    tables = synthetic_tables(1000)
    print("== 1000 tables, our search ==")
    print(f"{'topology':<10} {'chips':>5} {'devices':>7} {'plan s':>8} {'step us':>10} {'bound us':>10} {'quality':>8}")
    for name in ("v5p-128", "v6e-64", "tpu7x-128", "v5p-512", "v6e-256"):
        topo = parse_accelerator_type(name)
        seconds, plan = _timed(lambda: Partitioner(topo, 131072, 8192).plan(tables), repeats)
        print(f"{name:<10} {topo.num_chips:>5} {topo.num_devices:>7} {seconds:>8.2f} {plan.step_time_s * 1e6:>10.1f} "
              f"{plan.lower_bound_s * 1e6:>10.1f} {plan.quality:>7.3f}x")


def bench_vs_torchrec(num_tables: int, topology: str, repeats: int) -> None:
    from torchrec_tpu.planner.torchrec_adapter import assignments_from_torchrec, plan_with_torchrec

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    tables = synthetic_tables(num_tables, seed=1)
    topo = parse_accelerator_type(topology)
    batch, limit = 16384, 8192
    tr_seconds, module_plan = _timed(lambda: plan_with_torchrec(tables, topo, batch, limit), 1)
    scorer = Partitioner(topo, batch, limit)
    theirs = scorer.evaluate(tables, assignments_from_torchrec(module_plan, tables, scorer.options.builder))
    our_seconds, ours = _timed(lambda: Partitioner(topo, batch, limit).plan(tables), repeats)
    print(f"\n== {num_tables} tables x {topo.num_devices} devices ({topo.name}), same cost model ==")
    print(f"{'planner':<10} {'plan s':>8} {'step us':>10} {'quality':>8} {'max GiB':>8}")
    for label, secs, plan in (("torchrec", tr_seconds, theirs), ("ours", our_seconds, ours)):
        print(f"{label:<10} {secs:>8.3f} {plan.step_time_s * 1e6:>10.1f} {plan.quality:>7.3f}x "
              f"{plan.max_memory_bytes / 2**30:>8.2f}")
    print(f"speed-up (torchrec time / ours): {tr_seconds / our_seconds:.1f}x; "
          f"step-time ratio (torchrec / ours): {theirs.step_time_s / ours.step_time_s:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=60, help="tables in the head-to-head run")
    parser.add_argument("--topology", default="v5p-16", help="slice of the head-to-head run (v5p-16: 8 devices)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-scale", action="store_true", help="only the head-to-head run")
    args = parser.parse_args()
    if not args.skip_scale:
        bench_scale(args.repeats)
    bench_vs_torchrec(args.tables, args.topology, args.repeats)


if __name__ == "__main__":
    quiet_box.run(main)
