"""Does host preprocessing hide behind the training step? The sparsecore DLRM train step (world 1,
``build_sparsecore_model`` as ``torchrec-tpu train --engine sparsecore`` builds it) timed three ways
on the same in-memory batches:

- precomputed: every batch's input dist (validation, preprocessing, device inputs) done before the
  clock starts; the steps alone;
- pipelined: the train pipeline's prefetch thread (``PrefetchedBatches``, depth 2) runs the input
  dist of the next batches while the step runs: equal to precomputed when it overlaps fully;
- inline: the input dist inside each step (no overlap), for the cost of the input dist itself.

Each preprocessing engine (compiled C++ and numpy) runs in a fresh process. Steady state: the
lookup/update programs of every batch are compiled and ``--warmup`` steps run before the clock
starts. Shared 2-core box: read the ratios.

    .venv/bin/python bench/bench_sparsecore_overlap.py [--batch 2048] [--steps 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODES = ("precomputed", "pipelined", "inline")


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_tpu.pipeline import PrefetchedBatches
    from torchrec_tpu.train.distributed import process_group
    from torchrec_tpu.train.loop import train_step
    from torchrec_tpu.train.model import ModelSpec, ebc_of
    from torchrec_tpu.train.sparsecore_engine import _unwrap, build_dense_optimizer, build_sparsecore_model

    torch.set_num_threads(args.threads)
    names = tuple(f"cat_{i}" for i in range(args.features))
    spec = ModelSpec(feature_names=names, table_sizes=(args.rows,) * args.features, embedding_dim=args.dim,
                     dense_in_features=13, dense_layers=(512, 256, args.dim), over_layers=(512, 512, 256, 1))
    rng = np.random.default_rng(0)

    def batch() -> Batch:
        lengths = rng.integers(0, 2 * args.hot + 1, size=args.features * args.batch)
        ids = rng.integers(0, args.rows, size=int(lengths.sum()))
        kjt = KeyedJaggedTensor(keys=list(names), values=torch.from_numpy(ids), lengths=torch.from_numpy(lengths))
        return Batch(dense_features=torch.randn(args.batch, 13), sparse_features=kjt,
                     labels=torch.from_numpy(rng.integers(0, 2, size=args.batch)).float())

    batches = [batch() for _ in range(args.warmup + args.steps)]
    out = {}
    with process_group() as env:
        for mode in args.modes:
            model = build_sparsecore_model(spec, env, torch.device("cpu"), "adagrad", 0.005, args.batch, seed=0)
            optimizer = build_dense_optimizer(model, "adagrad", 0.005)
            ebc = ebc_of(_unwrap(model))
            for b in batches:  # every batch's programs compiled before the clock starts
                ebc.compile(b.sparse_features)
            for b in batches[: args.warmup]:
                train_step(model, optimizer, b)
            timed = batches[args.warmup:]
            start = time.perf_counter()
            if mode == "precomputed":
                source = [dataclasses.replace(b, sparse_features=ebc.prefetch(b.sparse_features)) for b in timed]
                start = time.perf_counter()
            elif mode == "pipelined":
                source = PrefetchedBatches(timed, ebc, torch.device("cpu"), depth=2)
            else:
                source = timed
            for b in source:
                train_step(model, optimizer, b)
            out[mode] = (time.perf_counter() - start) / len(timed)
        start = time.perf_counter()
        for b in timed:
            ebc.input_dist(b.sparse_features)
        out["input_dist"] = (time.perf_counter() - start) / len(timed)
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--features", type=int, default=26)
    parser.add_argument("--rows", type=int, default=100_000, help="rows per table")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hot", type=int, default=1, help="mean ids per sample per feature")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"sparsecore DLRM train step, batch {args.batch}, {args.features} tables x {args.rows:,} x {args.dim}, "
          f"{args.hot} ids per sample per feature on average, {args.threads} threads; ms per step over "
          f"{args.steps} steps after {args.warmup}")
    root = str(Path(__file__).resolve().parents[1])
    for engine, native in (("compiled", "1"), ("numpy", "0")):
        env = {**os.environ, "PYTHONPATH": root, "TORCHREC_TPU_NATIVE": native}
        done = subprocess.run([sys.executable, __file__, "--worker", *sys.argv[1:]], env=env, capture_output=True,
                              text=True)
        if done.returncode:
            raise RuntimeError(f"{engine} run failed:\n{done.stderr[-3000:]}")
        t = json.loads(done.stdout.strip().splitlines()[-1])
        base = t.get("precomputed")
        cells = [f"{m} {t[m] * 1e3:7.1f} ms" + (f" ({t[m] / base:.2f}x)" if base and m != "precomputed" else "")
                 for m in (*args.modes, "input_dist") if m in t]
        print(f"  preprocessing {engine:<8}: " + "   ".join(cells))


if __name__ == "__main__":
    main()
