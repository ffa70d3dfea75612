"""Managed-collision remap cost, the issue's two targets side by side.

1. The remap against stock TorchRec's ``ManagedCollisionCollection`` of ``MCHManagedCollisionModule``s
   on the same id stream: both remap the same drifting raw-id batches (26 features, one table each,
   LFU every ``--interval`` batches, tables of ``--rows`` slots; the anchor preset's shapes by
   default) from the same fresh state; the slots are checked equal on the first pass (the tests
   check every policy). Prints batches/s of each and the ratio (target >= 1.5x), best of
   ``--repeats`` passes, the engines alternating, one torch thread, and the same ratio in CPU time
   (``time.process_time``, less sensitive to other work than wall time).
2. What the remap adds to a training step: ``--step-repeats`` alternating fresh ``train`` runs of
   the anchor preset at world 1 (``bench_train_e2e.py --preset anchor``'s model and runs) on
   drifting synthetic data, with ``--zch all`` (LFU every ``--interval`` batches) and without;
   prints the median steady step time of each and the overhead (target <= 10%). The remap runs
   on the prefetch thread beside the step, so this is what it costs the job, not its CPU time.

Timings on a shared 2-core box are noisy: read the ratios, and only from a quiet run.

    .venv/bin/python bench/bench_zch_remap.py [--batch 2048 --rows 100000 --interval 10 --steps 40 --repeats 3
        --step-repeats 3 --step-rows 131072 | --skip-step]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import bench_train_e2e
import quiet_box
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.mc_modules import ManagedCollisionCollection, MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipelines.synthetic import SyntheticConfig, generate
from torchrec_tpu.sharding.zch import ZchSpec
from torchrec_tpu.sharding.zch_collection import ZchCollection


def stream(batch: int, features: int, steps: int, vocab: int) -> list[KeyedJaggedTensor]:
    """Zipf-like raw 64-bit ids over a vocabulary that drifts by 1% a batch."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        lengths = torch.randint(0, 3, (features * batch,), generator=generator)
        n = int(lengths.sum())
        rank = torch.floor(torch.exp(torch.rand(n, generator=generator) * torch.log(torch.tensor(float(vocab)))))
        ids = (rank.to(torch.int64) + step * vocab // 100) * 0x9E3779B97F4A7C15 % (2**62)
        out.append(KeyedJaggedTensor(keys=[f"f{i}" for i in range(features)], values=ids, lengths=lengths))
    return out


def torchrec_mcc(rows: int, features: int, spec: ZchSpec) -> ManagedCollisionCollection:
    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=rows, feature_names=[f"f{i}"])
               for i in range(features)]
    return ManagedCollisionCollection(
        {c.name: MCHManagedCollisionModule(zch_size=rows, device=torch.device("cpu"),
                                           eviction_policy=spec.eviction_policy(),
                                           eviction_interval=spec.eviction_interval) for c in configs}, configs)


def ours(rows: int, features: int, spec: ZchSpec) -> ZchCollection:
    return ZchCollection({f"t{i}": (rows, spec) for i in range(features)},
                         {f"t{i}": [f"f{i}"] for i in range(features)})


def timed(run, batches: list[KeyedJaggedTensor]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of ``run`` over ``batches``."""
    start, cpu = time.perf_counter(), time.process_time()
    for kjt in batches:
        run(kjt)
    return time.perf_counter() - start, time.process_time() - cpu


def remap_ratio(args: argparse.Namespace) -> None:
    """Part 1: the remap against TorchRec's module on the same stream."""
    torch.set_num_threads(1)  # as training runs (--num-threads 1): both remaps are single-threaded host work
    spec = ZchSpec("lfu", args.interval)
    batches = stream(args.batch, args.features, args.steps, 4 * args.rows)
    check_ref, check_ours = torchrec_mcc(args.rows, args.features, spec), ours(args.rows, args.features, spec)
    for kjt in batches:
        want, got = check_ref(kjt).to_dict(), check_ours(kjt)[0].to_dict()
        assert all(torch.equal(got[k].values(), jt.values()) for k, jt in want.items()), "slots differ"
    best = {"torchrec": (float("inf"),) * 2, "torchrec_tpu": (float("inf"),) * 2}
    for _ in range(args.repeats):
        reference = torchrec_mcc(args.rows, args.features, spec)
        run = timed(lambda kjt: (reference(kjt), reference.evict()), batches)
        best["torchrec"] = tuple(map(min, best["torchrec"], run))
        mine = ours(args.rows, args.features, spec)
        best["torchrec_tpu"] = tuple(map(min, best["torchrec_tpu"], timed(mine, batches)))
    for name, (wall, cpu) in best.items():
        print(f"{name:>13}: {args.steps / wall:8.1f} batches/s ({wall / args.steps * 1e3:.2f} ms/batch, "
              f"{cpu / args.steps * 1e3:.2f} ms CPU/batch)")
    (ref_wall, ref_cpu), (our_wall, our_cpu) = best["torchrec"], best["torchrec_tpu"]
    print(f"ratio torchrec_tpu / torchrec: {ref_wall / our_wall:.2f}x wall, {ref_cpu / our_cpu:.2f}x CPU "
          f"(batch {args.batch} x {args.features} features, {args.rows} rows, lfu every {args.interval})", flush=True)


def step_overhead(args: argparse.Namespace) -> None:
    """Part 2: the anchor preset's steady step with ``--zch all`` against without, alternating fresh runs."""
    # (--dense-lr: at the job's 0.05 the anchor model's loss passes 100x its first at step 2 and the
    # divergence guard ends the run, with or without --zch)
    train = bench_train_e2e.parse_args(["--preset", "anchor", "--worlds", "1", "--dense-device", "auto",
                                        "--dense-lr", "0.005", "--zch-eviction-interval", str(args.interval),
                                        *(["--rows", str(args.step_rows)] if args.step_rows else [])])
    rates: dict[str, list[float]] = {"": [], "all": []}
    with tempfile.TemporaryDirectory(prefix="bench_zch_remap_") as tmp:
        data = Path(tmp) / "data"
        # ids move up by half a table over the rows: new ids keep arriving, so evictions hand slots over
        generate(SyntheticConfig(num_rows=train.rows, rows_per_file=train.rows // 4,
                                 row_group_size=max(1, train.rows // 16), max_cardinality=train.num_embeddings,
                                 vocabulary_drift=0.5), data, progress=False)
        for i in range(args.step_repeats):
            for zch in ("", "all") if i % 2 == 0 else ("all", ""):
                train.zch = zch
                result = bench_train_e2e.run("sparsecore", 1, data, Path(tmp) / f"run{i}{zch}", train)
                rates[zch].append(result["steady"])
    off, on = (statistics.median(rates[z]) for z in ("", "all"))
    step_off, step_on = (train.batch_size / rate * 1e3 for rate in (off, on))
    print(f"anchor step, world 1, batch {train.batch_size}: {step_off:.1f} ms without --zch, {step_on:.1f} ms with "
          f"--zch all (lfu every {args.interval}), medians of {args.step_repeats} alternating runs each")
    print(f"step-time overhead of the remap: {step_on / step_off - 1:+.1%} (target <= +10%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--features", type=int, default=26)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--interval", type=int, default=10, help="batches between evictions, both parts")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-repeats", type=int, default=3, help="train runs with and without --zch each")
    parser.add_argument("--step-rows", type=int, default=0, help="synthetic rows of the train runs (default: "
                        "the anchor preset's)")
    parser.add_argument("--skip-step", action="store_true", help="the remap ratio only")
    args = parser.parse_args()
    remap_ratio(args)
    if not args.skip_step:
        step_overhead(args)


if __name__ == "__main__":
    quiet_box.run(main)
