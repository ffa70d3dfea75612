"""Does host preprocessing hide behind the training step? The sparsecore DLRM train step (world 1,
the model, optimizer and step function as ``torchrec-tpu train --engine sparsecore`` builds them:
with ``--dense-device auto`` on a CPU-only host the one-program step for small towers, CPU towers
for large ones) timed three ways on the same in-memory batches:

- precomputed: every batch's input dist (validation, preprocessing, device inputs) done before the
  clock starts; the steps alone;
- pipelined: the train pipeline's prefetch thread (``PrefetchedBatches``, depth 2) runs the input
  dist of the next batches while the step runs: equal to precomputed when it overlaps fully;
- inline: the input dist inside each step (no overlap), for the cost of the input dist itself.

Each preprocessing engine (compiled C++ and numpy) runs in a fresh process with one model; the
three modes alternate over ``--rounds`` rounds (the order rotating each round); a mode's number is
the median over the rounds of its mean step time (the round's wall time, waiting for its batches
and its last step, over its steps), with the range; ``input_dist`` and ``python`` are medians (and
ranges) over the rounds. ``hidden``
is the share of the inline input dist cost that the pipeline hides, 1 - (pipelined - precomputed)
/ (inline - precomputed), from the medians (shown when inline is the slower). ``python`` is how
much pure-Python work the main thread gets done while another thread runs input dists back to
back, relative to an idle process: below 1 where the input dist holds the GIL (or, on a box with
few cores, takes the main thread's core). Steady state: the
lookup/update programs of every batch are compiled and ``--warmup`` steps run before the clock
starts.

    .venv/bin/python bench/bench_sparsecore_overlap.py [--batch 2048] [--steps 16] [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import quiet_box

MODES = ("precomputed", "pipelined", "inline")
PROBE_SECONDS = 0.5


def python_rate(seconds: float) -> float:
    """Iterations per second of a pure-Python loop on this thread over ``seconds``."""
    count, start = 0, time.perf_counter()
    stop = start + seconds
    while time.perf_counter() < stop:
        for _ in range(1000):
            count += 1
    return count / (time.perf_counter() - start)


def gil_probe(run_input_dists, seconds: float = PROBE_SECONDS) -> float:
    """Main-thread Python throughput while ``run_input_dists(stop)`` runs on another thread,
    relative to the same loop with nothing else running."""
    idle = python_rate(seconds)
    stop = threading.Event()
    thread = threading.Thread(target=run_input_dists, args=(stop,))
    thread.start()
    try:
        busy = python_rate(seconds)
    finally:
        stop.set()
        thread.join()
    return busy / idle


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_tpu.pipeline import PrefetchedBatches
    from torchrec_tpu.train.config import EngineConfig, OptimConfig
    from torchrec_tpu.train.distributed import process_group
    from torchrec_tpu.train.engines.sparsecore_engine import SparseCoreEngine, unwrap_dense
    from torchrec_tpu.train.model import ModelSpec, ebc_of

    torch.set_num_threads(args.threads)
    names = tuple(f"cat_{i}" for i in range(args.features))
    spec = ModelSpec(feature_names=names, table_sizes=(args.rows,) * args.features, embedding_dim=args.dim,
                     dense_in_features=13, dense_layers=_layers(args.dense_arch) + (args.dim,),
                     over_layers=_layers(args.over_arch) + (1,))
    rng = np.random.default_rng(0)

    def batch() -> Batch:
        lengths = rng.integers(0, 2 * args.hot + 1, size=args.features * args.batch)
        ids = rng.integers(0, args.rows, size=int(lengths.sum()))
        kjt = KeyedJaggedTensor(keys=list(names), values=torch.from_numpy(ids), lengths=torch.from_numpy(lengths))
        return Batch(dense_features=torch.randn(args.batch, 13), sparse_features=kjt,
                     labels=torch.from_numpy(rng.integers(0, 2, size=args.batch)).float())

    batches = [batch() for _ in range(args.warmup + args.steps)]
    timed = batches[args.warmup:]
    optim = OptimConfig(sparse_optimizer="adagrad", sparse_lr=0.005, dense_optimizer="adagrad", dense_lr=0.005)
    engine = SparseCoreEngine(optim, EngineConfig(dense_device=args.dense_device), args.batch, seed=0)
    with process_group(device_tensors=engine.needs_device_tensors) as env:
        layout = engine.step_layout(spec, env)
        model = engine.build_model(spec, env, torch.device("cpu"), layout)
        optimizer = engine.build_optimizer(model, layout)
        step = engine.step_function(model, optimizer, layout)
        ebc = ebc_of(unwrap_dense(model))
        for b in batches:  # every batch's programs compiled before the clock starts
            ebc.compile(b.sparse_features)
        for b in PrefetchedBatches(batches[: args.warmup], ebc, torch.device("cpu"), depth=2):
            loss = step(model, optimizer, b)
        float(loss)  # the steps dispatch asynchronously: wait for them

        def steps(mode: str) -> tuple[float, float]:
            source = timed
            if mode == "precomputed":
                source = [dataclasses.replace(b, sparse_features=ebc.prefetch(b.sparse_features)) for b in timed]
            elif mode == "pipelined":
                source = PrefetchedBatches(timed, ebc, torch.device("cpu"), depth=2)
            start, cpu, loss = time.perf_counter(), time.process_time(), None
            for b in source:  # includes waiting for each batch
                loss = step(model, optimizer, b)
            float(loss)  # steps dispatch asynchronously: the round ends when its last step is done
            return (time.perf_counter() - start) / len(timed), (time.process_time() - cpu) / len(timed)

        def input_dists() -> float:
            start = time.perf_counter()
            for b in timed:
                ebc.input_dist(b.sparse_features)
            return (time.perf_counter() - start) / len(timed)

        def input_dists_until(stop: threading.Event) -> None:
            while not stop.is_set():
                for b in timed:
                    ebc.input_dist(b.sparse_features)
                    if stop.is_set():
                        return

        out: dict[str, list[float]] = {m: [] for m in (*args.modes, *(f"{m} cpu" for m in args.modes),
                                                       "input_dist", "python")}
        for r in range(args.rounds):
            for mode in args.modes[r % len(args.modes):] + args.modes[: r % len(args.modes)]:
                wall, cpu = steps(mode)
                out[mode].append(wall)
                out[f"{mode} cpu"].append(cpu)
            out["input_dist"].append(input_dists())
            out["python"].append(gil_probe(input_dists_until))
    print(json.dumps(out))


def _layers(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def summary(times: dict[str, list[float]], modes: list[str]) -> str:
    """One line: every mode's median ms (range), ratios to precomputed, the hidden share."""
    med = {m: statistics.median(v) for m, v in times.items()}
    base = med.get("precomputed")
    cells = []
    for m in (*modes, "input_dist"):
        if m in med:
            ratio = f" = {med[m] / base:.2f}x" if base and m != "precomputed" else ""
            low, high = min(times[m]), max(times[m])
            cores = f", {med[f'{m} cpu'] / med[m]:.1f} cores" if f"{m} cpu" in med else ""
            cells.append(f"{m} {med[m] * 1e3:.1f} ms ({low * 1e3:.1f}-{high * 1e3:.1f}{cores}){ratio}")
    if {"precomputed", "pipelined", "inline"} <= med.keys() and med["inline"] > base:
        cells.append(f"hidden {1 - (med['pipelined'] - base) / (med['inline'] - base):.0%}")
    cells.append(f"python {med['python']:.2f} ({min(times['python']):.2f}-{max(times['python']):.2f})")
    return "   ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--features", type=int, default=26)
    parser.add_argument("--rows", type=int, default=100_000, help="rows per table")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hot", type=int, default=1, help="mean ids per sample per feature")
    parser.add_argument("--steps", type=int, default=16, help="timed steps per mode and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of all modes (default 5)")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--dense-arch", default="512,256", help="bottom MLP before its last layer (of --dim)")
    parser.add_argument("--over-arch", default="512,512,256", help="top MLP before its last layer (of 1)")
    parser.add_argument("--dense-device", default="auto", choices=("auto", "cpu", "tpu"),
                        help="the job's --dense-device (default auto)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.steps, args.rounds, args.batch, args.features, args.rows, args.dim) < 1 or args.warmup < 0:
        parser.error("--steps, --rounds, --batch, --features, --rows and --dim must be >= 1, --warmup >= 0")
    if args.worker:
        worker(args)
        return
    print(f"sparsecore DLRM train step, batch {args.batch}, {args.features} tables x {args.rows:,} x {args.dim}, "
          f"{args.hot} ids per sample per feature on average, {args.threads} threads; ms per step, median "
          f"(range) of {args.rounds} rounds of {args.steps} steps after {args.warmup}; load "
          f"{os.getloadavg()[0]:.2f}")
    root = str(Path(__file__).resolve().parents[1])
    for engine, native in (("compiled", "1"), ("numpy", "0")):
        env = {**os.environ, "PYTHONPATH": root, "TORCHREC_TPU_NATIVE": native}
        done = subprocess.run([sys.executable, __file__, "--worker", *sys.argv[1:]], env=env, capture_output=True,
                              text=True)
        if done.returncode:
            raise RuntimeError(f"{engine} run failed:\n{done.stderr[-3000:]}")
        times = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"  preprocessing {engine:<8}: {summary(times, args.modes)}", flush=True)
    print(f"  load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    quiet_box.run(main)
