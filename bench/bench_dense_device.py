"""``--engine sparsecore`` training step with the dense towers on the tpu device (the job's compiled
step: one XLA program for the embedding lookup, dense towers + interaction + optimizer and the
fused embedding update; and the eager per-op path) vs on the CPU, same model, init and batches, in
one run; prints samples/s and the ratios to cpu. The batches' input dist runs ahead, untimed, as
the job's prefetch thread runs it.

Model sizes: ``cli`` is ``torchrec-tpu train``'s default model (26 tables x dim 16, dense 64-16,
over 64-32-1, batch 512); ``reference`` is the anchor config (26 tables x 100k x 64, dense
512-256-64, over 512-512-256-1, batch 2048). Adagrad dense and sparse. The loss is read back every
``--log-every`` steps, as the training loop does (the sparse update reads the pooled embeddings'
gradient each step, so every step's device work is timed in full). Warm-up
steps (where XLA compiles) are excluded from samples/s; the first step's time is printed apart
(it hits the persistent compile cache from the second run on). Every placement runs at each
``--threads`` count of torch CPU threads (default 1 and 2, as bench_train_step); XLA:CPU keeps its
default thread pool, so the tpu side may use more cores than ``--threads``. Here the tpu device is XLA:CPU under JAX,
on a shared 2-core box: the ratio measures our overhead against torch's own CPU kernels, not a TPU.

    .venv/bin/python bench/bench_dense_device.py [--size cli|reference] [--steps 20] [--warmup 3]
        [--placements cpu,tpu,tpu-eager]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Sequence

import quiet_box
import torch
from torchrec.datasets.utils import Batch

import torch_tpu  # noqa: F401  (before any backward: autograd sizes its device queues at the first one)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_torchrec_dlrm import random_batches, reference_spec, samples_per_sec  # noqa: E402
from bench_train_step import thread_counts  # noqa: E402

from torchrec_tpu.train.config import EngineConfig, OptimConfig  # noqa: E402
from torchrec_tpu.train.distributed import process_group  # noqa: E402
from torchrec_tpu.train.engines.dense_placement import dense_device  # noqa: E402
from torchrec_tpu.train.engines.dense_step import step_function  # noqa: E402
from torchrec_tpu.train.engines.sparsecore_engine import build_dense_optimizer, build_sparsecore_model  # noqa: E402
from torchrec_tpu.train.engines.step_layout import sparsecore_layout
from torchrec_tpu.train.loop import train_step  # noqa: E402
from torchrec_tpu.train.model import ModelSpec, ebc_of  # noqa: E402

OPTIM = OptimConfig(sparse_optimizer="adagrad", sparse_lr=0.01, dense_optimizer="adagrad", dense_lr=0.01)
SIZES = {"cli": 512, "reference": 2048}  # default batch per size
PLACEMENTS = ("cpu", "tpu", "tpu-eager")  # tpu: the job's compiled step; tpu-eager: per-op dispatch


def spec_for(size: str, num_embeddings: int) -> ModelSpec:
    if size == "reference":
        return reference_spec(num_embeddings)
    cli = reference_spec(num_embeddings, embedding_dim=16)
    return ModelSpec(feature_names=cli.feature_names, table_sizes=cli.table_sizes, embedding_dim=16,
                     dense_in_features=cli.dense_in_features, dense_layers=(64, 16), over_layers=(64, 32, 1))


def measure(placement: str, spec: ModelSpec, batches, args: argparse.Namespace) -> tuple[float, float]:
    """(seconds of the first step, steady samples/s) of the sparsecore training step with the
    dense towers placed as ``placement`` says."""
    device_name = placement.split("-")[0]
    with process_group() as env:
        torch.manual_seed(0)
        device = dense_device(device_name)
        layout = sparsecore_layout(EngineConfig(), OPTIM, env.world_size, args.batch_size // env.world_size, device)
        model = build_sparsecore_model(spec, env, layout, OPTIM, EngineConfig(), args.batch_size, seed=0)
        optimizer = build_dense_optimizer(model, OPTIM, layout.dense_device)
        step_fn = train_step if placement == "tpu-eager" else step_function(model, optimizer, layout)
        ebc = ebc_of(model)
        batches = [Batch(b.dense_features, ebc.prefetch(b.sparse_features), b.labels) for b in batches]

        pending: list[torch.Tensor] = []

        def read_losses() -> None:
            if pending:
                torch.stack(pending).tolist()
                pending.clear()

        def step(batch) -> None:  # the loss is read every --log-every steps, as the training loop does
            pending.append(step_fn(model, optimizer, batch))
            if len(pending) >= args.log_every:
                read_losses()

        start = time.perf_counter()
        float(step_fn(model, optimizer, batches[0]))
        first = time.perf_counter() - start
        return first, samples_per_sec(step, batches, args.warmup - 1, args.steps, f"dense on {placement}",
                                      finish=read_losses)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="cli", help="model size (default: cli)")
    parser.add_argument("--batch-size", type=int, default=0, help="default: 512 (cli) / 2048 (reference)")
    parser.add_argument("--num-embeddings", type=int, default=100_000, help="rows per table (default: 100000)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default: 20)")
    parser.add_argument("--log-every", type=int, default=20, help="read the loss every N steps (default: 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: 3)")
    parser.add_argument("--threads", default="1,2", help="torch CPU thread counts, comma-separated (default: 1,2)")
    parser.add_argument("--placements", default="cpu,tpu", help=f"comma-separated, of {list(PLACEMENTS)} "
                        "(default: cpu,tpu)")
    args = parser.parse_args(argv)
    args.placements = [p.strip() for p in args.placements.split(",") if p.strip()]
    unknown = [p for p in args.placements if p not in PLACEMENTS]
    if unknown or "cpu" not in args.placements:
        parser.error(f"--placements must include cpu and name only {list(PLACEMENTS)}; got {args.placements}")
    try:
        args.threads = thread_counts(args.threads)
    except ValueError as error:
        parser.error(str(error))
    args.batch_size = args.batch_size or SIZES[args.size]
    if args.batch_size < 1 or args.steps < 1 or args.warmup < 1 or args.num_embeddings < 1 or args.log_every < 1:
        parser.error("--batch-size, --steps, --warmup, --log-every and --num-embeddings must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    spec = spec_for(args.size, args.num_embeddings)
    batches = random_batches(spec, args.batch_size, count=4)
    print(f"sparsecore training step, {args.size} model, batch {args.batch_size}, world 1; tpu = XLA:CPU here "
          f"at its default settings; load average {os.getloadavg()[0]:.2f}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        results = {name: measure(name, spec, batches, args) for name in args.placements}
        reference = results["cpu"][1]
        for name, (first, rate) in results.items():
            print(f"  {threads} thread(s): dense on {name:<9} {rate:>9,.0f} samples/s  ({rate / reference:.2f}x cpu)  "
                  f"first step {first:.1f} s")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    quiet_box.run(main)
