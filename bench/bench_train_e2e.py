"""End-to-end ``torchrec-tpu train`` throughput: ``--engine sparsecore`` vs the stock TorchRec DMP
engine (``--engine torchrec``), same model, data, batch and optimizers, world size 1 and 2.

Every run is a fresh process (two loopback processes for world 2, torchrun's environment) going
through ``run_job`` on the same synthetic Parquet files, generated once; the engines alternate
and each ratio is the median over ``--repeats`` runs (3 at one rank, 5 at two, with their spread).
Two numbers per run: the whole loop (reader, host preprocessing, steps, updates; first-step
compiles included, evaluation excluded) and the steady state (the loop's logged windows after the
first, i.e. without warm-up).
Timings on a shared 2-core box are noisy: read the medians. Per world it also prints the bound on
the ratio for an engine running its dense half as TorchRec does (the stock towers, interaction
and Adagrad step in CPU eager torch): that dense half timed in this process against TorchRec's
steady step, i.e. the ratio such an engine whose sparse part, input and overhead took no time at
all would reach. The sparsecore engine's ``--dense-device`` (default ``auto``: tpu at one rank,
where lookup, dense step and embedding update run as one compiled program) is not bound by it;
``--dense-device cpu`` is. By default (``--dense-device auto cpu tpu``) the sparsecore engine runs once per
placement (each alternating with TorchRec's runs) and the bench prints the placement ``auto`` picked beside
the forced placements' ratios, and whether it is the faster one (within 5%).

Presets: ``default`` is ``torchrec-tpu train``'s own defaults (dim 16, dense 64-16, over 64-32-1,
batch 512, 1 thread); ``anchor`` the issue's anchor config (26 tables x 100k x 64, batch 2048,
dense 512-256-64, over 512-512-256-1, Adagrad, 2 threads); ``mlperf`` TorchRec's MLPerf DLRM-v2 TPU benchmark model
(DLRM_DCN, MLPerf's multi-hot sizes summing to 214, its 26 tables' cardinalities capped at 100k
rows (MLPerf's five 40M-row tables alone would be 102 GB at dim 128; capped: 0.93M rows, 0.47 GB
plus Adagrad's state) x 128, dense 512-256-128, over 1024-1024-512-256-1, 3 cross layers of low
rank 512, Adagrad, batch 256, 2 threads). Flags given explicitly override it; ``--precision
bf16`` runs both engines' towers in bf16 autocast.

    .venv/bin/python bench/bench_train_e2e.py [--preset anchor] [--rows N] [--batch-size N] [--repeats N] [--worlds 1 2]
        [--dense-device auto]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import quiet_box

from torchrec_tpu.launcher import xla_cpu_env
from torchrec_tpu.train.distributed import bind_to_local_cpus
from torchrec_tpu.train.engine_kinds import ENGINES as TRAIN_ENGINES

ENGINES = ("torchrec", "sparsecore")
AUTO_TOLERANCE = 1.05  # auto's placement counts as the faster one within 5% of its step rate
NUM_SPARSE, NUM_DENSE = 26, 13  # Criteo's features, as the synthetic data has
# MLPerf DLRM-DCNv2's (TorchRec's dlrm_main / train_dlrm_mlperf_tpu.py): ids per feature (sum 214), table rows
MLPERF_MULTI_HOT_SIZES = "3,2,1,2,6,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,100,27,10,3,1,1"
MLPERF_CARDINALITIES = (40_000_000, 39_060, 17_295, 7_424, 20_265, 3, 7_122, 1_543, 63, 40_000_000, 3_067_956,
                        405_282, 10, 2_209, 11_938, 155, 4, 976, 14, 40_000_000, 40_000_000, 40_000_000, 590_152,
                        12_973, 108, 36)
MLPERF_ROW_CAP = 100_000  # per table, to fit this 23 GB box shared by several jobs
LOG_EVERY = 8
# model/run settings of each preset; None in a flag means "the preset's"
PRESETS: dict[str, dict[str, object]] = {
    "default": dict(rows=32768, batch_size=512, embedding_dim=16, dense_arch="64,16", over_arch="64,32,1",
                    threads=1),
    # dense lr 0.005 (anchor, mlperf): Adagrad's first step moves every weight by the lr, and at 0.05
    # the 512-wide towers' loss reaches ~6e4 at step 2, which the job's divergence guard stops
    "anchor": dict(rows=131072, batch_size=2048, embedding_dim=64, dense_arch="512,256,64",
                   over_arch="512,512,256,1", threads=2, dense_lr=0.005),
    # batch 256: at 1024 one rank's multi-hot ids (214 a sample) overflow a SparseCore partition
    # (10,652 ids > the hardware's 4,096); MLPerf spreads its batch over many chips' SparseCores.
    # 8192 rows: 24 steps of 1-4 s on this box
    "mlperf": dict(rows=8192, batch_size=256, embedding_dim=128, dense_arch="512,256,128",
                   over_arch="1024,1024,512,256,1", threads=2, model="dlrm_dcn", dcn_num_layers=3,
                   dcn_low_rank_dim=512, multi_hot_sizes=MLPERF_MULTI_HOT_SIZES, num_embeddings=MLPERF_ROW_CAP,
                   dense_lr=0.005,
                   num_embeddings_per_feature=",".join(str(min(n, MLPERF_ROW_CAP)) for n in MLPERF_CARDINALITIES)),
}
# what a preset leaves unsaid
COMMON: dict[str, object] = dict(num_embeddings=100_000, dense_lr=0.05, model="dlrm", dcn_num_layers=3,
                                 dcn_low_rank_dim=16, multi_hot_sizes="", num_embeddings_per_feature="")
MODEL_FLAGS = ("batch_size", "embedding_dim", "dense_arch", "over_arch", "threads", "num_embeddings", "steps", "zch",
               "zch_eviction_interval", "dense_lr",
               "model", "dcn_num_layers", "dcn_low_rank_dim", "multi_hot_sizes", "num_embeddings_per_feature",
               "precision", "dense_device", "sparse_backend")


def worker(args: argparse.Namespace) -> None:
    """One training run in this process (one rank); rank 0 prints its throughputs as JSON."""
    from torchrec_tpu.train.config import TrainConfig
    from torchrec_tpu.train.job import run_job

    config = TrainConfig.from_options(
        engine=args.engine, model=args.model, data=args.data, log_dir=args.log_dir, eval_files=1,
        num_embeddings=args.num_embeddings, embedding_dim=args.embedding_dim, dense_arch=args.dense_arch,
        over_arch=args.over_arch, batch_size=args.batch_size, eval_batch_size=args.batch_size, epochs=1,
        max_steps=args.steps, num_threads=args.threads, dense_lr=args.dense_lr, progress=False, log_every=LOG_EVERY,
        dcn_num_layers=args.dcn_num_layers, dcn_low_rank_dim=args.dcn_low_rank_dim, precision=args.precision,
        **({"multi_hot_sizes": args.multi_hot_sizes} if args.multi_hot_sizes else {}),
        **({"num_embeddings_per_feature": args.num_embeddings_per_feature} if args.num_embeddings_per_feature else {}),
        **({"dense_device": args.dense_device[0]} if args.engine == "sparsecore" else {}),
        **({"sparse_backend": args.sparse_backend} if args.engine == "sparsecore" and args.sparse_backend else {}),
        **({"zch": args.zch, "zch_eviction_interval": args.zch_eviction_interval} if args.zch else {}),
    )
    programs, towers_on = _count_programs()
    summary = run_job(config)
    if summary.primary:
        print(json.dumps({"whole": summary.result.samples_per_sec, "steady": steady_rate(Path(args.log_dir)),
                          "steps": summary.result.steps,
                          "programs": statistics.median(programs[1:] or programs or [0]),
                          "towers_on": towers_on[-1] if towers_on else ""}))


def _count_programs() -> tuple[list[int], list[str]]:
    """Make every engine's step function record the tpu programs each step dispatches (eager ops'
    programs and step programs) into the first returned list, and the device its step layout put
    the towers on (what ``--dense-device`` resolved to) into the second."""
    from torchrec_tpu.train.engine_kinds import ENGINES

    counts: list[int] = []
    towers_on: list[str] = []
    for engine in {kind.load() for kind in ENGINES.values()}:
        original = engine.step_function

        def step_function(self, model, optimizer, layout, original=original):
            step = original(self, model, optimizer, layout)
            towers_on.append(layout.dense_device.type)

            def counted(model, optimizer, batch):
                before = _programs_so_far()
                loss = step(model, optimizer, batch)
                counts.append(_programs_so_far() - before)
                return loss

            return counted

        engine.step_function = step_function
    return counts, towers_on


def _programs_so_far() -> int:
    """tpu programs this process dispatched: eager ops' and step programs (0 before torch_tpu loads)."""
    op_jit, step_program = (sys.modules.get(f"torch_tpu.{m}") for m in ("eager.op_jit", "compile.step.step_program"))
    eager = op_jit.stats().hits + op_jit.stats().misses if op_jit else 0
    return eager + (step_program.programs_run() if step_program else 0)


def steady_rate(log_dir: Path) -> float:
    """Samples/s over the logged windows after the first (equal windows: their harmonic mean)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir)).Reload().Scalars("train/samples_per_sec")
    rates = [e.value for e in events[1:]] or [e.value for e in events]
    return len(rates) / sum(1.0 / r for r in rates)


def run(engine: str, world: int, data: Path, log_dir: Path, args: argparse.Namespace, towers: str = "auto") -> dict:
    """One fresh run of ``engine`` on ``world`` loopback processes (sparsecore: ``--dense-device
    towers``); rank 0's throughputs. A failed run is reported and run once more (TorchRec's
    processes sometimes abort at exit, "terminate called without an active exception"); a second
    failure raises."""
    try:
        return _run_once(engine, world, data, log_dir, args, towers)
    except RuntimeError as error:
        print(f"  (retrying once: {str(error).splitlines()[0]} with: {str(error).splitlines()[-1]})", flush=True)
        return _run_once(engine, world, data, log_dir / "retry", args, towers)


def _run_once(engine: str, world: int, data: Path, log_dir: Path, args: argparse.Namespace, towers: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--engine", engine, "--data", str(data), "--log-dir", str(log_dir)]
    flags = {**vars(args), "dense_device": towers}
    cmd += [arg for name in MODEL_FLAGS for arg in (f"--{name.replace('_', '-')}", str(flags[name]))]
    env = engine_env(engine)
    if world > 1:
        env.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()))
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)} if world > 1 else env,
                              stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    outputs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outputs):
        if p.returncode:
            raise RuntimeError(f"{engine} world {world} failed:\n{err[-3000:]}")
    return json.loads(outputs[0][0].strip().splitlines()[-1])


def engine_env(engine: str) -> dict[str, str]:
    """The environment of a worker of ``engine``: as ``torchrec-tpu train`` starts its processes
    (the sparsecore engine's with glibc's malloc and libgomp's spin set up for XLA:CPU,
    ``launcher.xla_cpu_env``; stock TorchRec's as they are)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return {**env, **xla_cpu_env()} if TRAIN_ENGINES[engine].runs_xla_cpu else env


def dense_step_ms(args: argparse.Namespace, batch: int, threads: int, steps: int = 10) -> float:
    """Median ms of the model's dense half alone at ``batch`` rows (dense towers, interaction or DCN,
    BCE, backward, Adagrad) on CPU eager torch with the run's threads and precision: TorchRec's
    dense half (and ours with ``--dense-device cpu``), so it bounds the ratio of such engines
    (:func:`ratio_cap`)."""
    import torch

    from torchrec_tpu.train.engines.dense_step import DLRMDenseLoss
    from torchrec_tpu.train.model import ModelSpec, build_dlrm

    torch.set_num_threads(threads)
    dcn = args.model == "dlrm_dcn"
    spec = ModelSpec(feature_names=tuple(f"f{i}" for i in range(NUM_SPARSE)), table_sizes=(8,) * NUM_SPARSE,
                     embedding_dim=args.embedding_dim, dense_in_features=NUM_DENSE,
                     dense_layers=tuple(int(x) for x in args.dense_arch.split(",")),
                     over_layers=tuple(int(x) for x in args.over_arch.split(",")),
                     dcn_num_layers=args.dcn_num_layers if dcn else 0,
                     dcn_low_rank_dim=args.dcn_low_rank_dim if dcn else 0)
    model = DLRMDenseLoss(build_dlrm(spec, dense_device=torch.device("cpu")), args.precision)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.01)
    inputs = (torch.randn(batch, NUM_DENSE), torch.randn(batch, NUM_SPARSE, args.embedding_dim, requires_grad=True),
              torch.randint(0, 2, (batch,)).float())
    times = []
    for i in range(steps + 3):
        start = time.perf_counter()
        optimizer.zero_grad()
        model(*inputs).backward()
        optimizer.step()
        if i >= 3:  # warm-up steps excluded
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def ratio_cap(torchrec_samples_per_s: float, world: int, args: argparse.Namespace) -> tuple[float, float]:
    """(dense ms per step, the largest sparsecore/torchrec ratio any engine could reach): TorchRec's
    step time over the dense half's, i.e. the ratio with the sparse part, input and everything
    else of ours taking no time at all (Amdahl). The dense half is timed as one rank runs it: on
    the first of ``world`` equal blocks of this host's CPUs (the ranks' binding), with at most as
    many threads as the block has CPUs."""
    everywhere = os.sched_getaffinity(0)
    block = bind_to_local_cpus(0, world) or everywhere
    try:
        dense_ms = dense_step_ms(args, args.batch_size // world, min(args.threads, len(block)))
    finally:
        os.sched_setaffinity(0, everywhere)
    return dense_ms, (args.batch_size / torchrec_samples_per_s * 1e3) / dense_ms


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="default", help="model and run settings "
                        "(default: default; see the module docstring)")
    parser.add_argument("--rows", type=int, help="synthetic rows, 1/4 held out (default: the preset's)")
    parser.add_argument("--batch-size", type=int, help="global batch (default: the preset's)")
    parser.add_argument("--embedding-dim", type=int, help="dim of every table (default: the preset's)")
    parser.add_argument("--dense-arch", help="bottom MLP, ending in the embedding dim (default: the preset's)")
    parser.add_argument("--over-arch", help="top MLP, ending in 1 (default: the preset's)")
    parser.add_argument("--threads", type=int, help="torch threads per rank (default: the preset's)")
    parser.add_argument("--steps", type=int, default=0, help="stop after N steps (default 0: one epoch)")
    parser.add_argument("--num-embeddings", type=int, help="rows per table, at most (default: the preset's)")
    parser.add_argument("--model", choices=("dlrm", "dlrm_dcn"), help="(default: the preset's)")
    parser.add_argument("--dcn-num-layers", type=int, help="DCN cross layers, dlrm_dcn (default: the preset's)")
    parser.add_argument("--dcn-low-rank-dim", type=int, help="DCN low rank, dlrm_dcn (default: the preset's)")
    parser.add_argument("--multi-hot-sizes", help="ids per feature, comma-separated (default: the preset's)")
    parser.add_argument("--num-embeddings-per-feature", help="rows of each table, comma-separated (default: the "
                        "preset's; else --num-embeddings)")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                        help="the towers' matmuls, both engines (default: fp32)")
    parser.add_argument("--dense-device", nargs="+", default=["auto", "cpu", "tpu"], choices=("auto", "cpu", "tpu"),
                        help="the sparsecore engine's --dense-device, one sparsecore run per value and repeat; "
                             "auto's pick is printed beside the forced placements (default: auto cpu tpu)")
    parser.add_argument("--sparse-backend", default="", choices=("", "auto", "xla", "ops"),
                        help="the sparsecore engine's --sparse-backend (default: the job's)")
    parser.add_argument("--dense-lr", type=float, default=None, help="the towers' learning rate, both engines "
                        "(default: the preset's: 0.005 at anchor and mlperf, else 0.05, the job's)")
    parser.add_argument("--zch", default="", help="the sparsecore engine's --zch TABLES (default: none)")
    parser.add_argument("--zch-eviction-interval", type=int, default=100,
                        help="the sparsecore engine's --zch-eviction-interval (default: 100, the job's)")
    parser.add_argument("--repeats", type=int, help="runs per engine and world (default: 3 at one rank, 5 at "
                        "several, whose runs spread more)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2], help="world sizes (default: 1 2)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--log-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, value in {**COMMON, **PRESETS[args.preset]}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.rows < 8 or args.batch_size < 1 or args.steps < 0 or (args.repeats or 1) < 1 or min(args.worlds) < 1:
        parser.error("--rows >= 8, --batch-size >= 1, --steps >= 0, --repeats >= 1 and --worlds >= 1 are required")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    from pipelines.synthetic import SyntheticConfig, generate

    with tempfile.TemporaryDirectory(prefix="bench_train_e2e_") as tmp:
        data = Path(tmp) / "data"
        generate(SyntheticConfig(num_rows=args.rows, rows_per_file=args.rows // 4,
                                 row_group_size=max(1, args.rows // 16),
                                 max_cardinality=args.num_embeddings), data, progress=False)
        tables = (f"{len(args.num_embeddings_per_feature.split(','))} tables, "
                  f"{sum(int(n) for n in args.num_embeddings_per_feature.split(',')):,} rows" if
                  args.num_embeddings_per_feature else f"26 tables x {args.num_embeddings}")
        hot = (f", multi-hot {sum(int(n) for n in args.multi_hot_sizes.split(','))} ids per sample"
               if args.multi_hot_sizes else "")
        cross = (f", {args.dcn_num_layers} cross layers of rank {args.dcn_low_rank_dim}"
                 if args.model == "dlrm_dcn" else "")
        print(f"train end to end, preset {args.preset}, {args.precision}: {args.model}, {tables} x "
              f"{args.embedding_dim}{hot}, dense {args.dense_arch}, over {args.over_arch}{cross}, "
              f"batch {args.batch_size}, {args.rows} rows, {args.threads} thread(s) per rank, median of "
              f"{args.repeats or '3 (one rank) or 5 (several)'} alternating fresh runs; "
              f"load {os.getloadavg()[0]:.2f}; shared box, noisy")
        for world in args.worlds:
            bench_world(world, data, Path(tmp), args)


def repeats_at(world: int) -> int:
    """Runs per engine when ``--repeats`` is not given: several ranks' runs spread more (0.8-1.25x seen)."""
    return 3 if world == 1 else 5


def bench_world(world: int, data: Path, tmp: Path, args: argparse.Namespace) -> None:
    """``--repeats`` alternating runs of TorchRec and of sparsecore at each ``--dense-device`` on
    ``world`` ranks; prints the ratios, the bound, the programs per step and auto's placement."""
    variants = [("torchrec", "")] + [("sparsecore", towers) for towers in dict.fromkeys(args.dense_device)]
    label = {v: f"{v[0]}[{v[1]}]" if v[1] and len(variants) > 2 else v[0] for v in variants}
    results: dict[tuple[str, str], list[dict]] = {v: [] for v in variants}
    for i in range(args.repeats or repeats_at(world)):
        for engine, towers in variants if i % 2 == 0 else variants[::-1]:
            results[engine, towers].append(run(engine, world, data, tmp / f"{engine}{towers}_{world}_{i}", args,
                                               towers or "auto"))
    torchrec = results["torchrec", ""]
    torchrec_rate = statistics.median(r["steady"] for r in torchrec)
    dense_ms, cap = ratio_cap(torchrec_rate, world, args)
    print(f"  world {world} bound: TorchRec's dense half alone (CPU eager, as one rank runs it) takes "
          f"{dense_ms:.1f} ms per step; TorchRec's steady step {args.batch_size / torchrec_rate * 1e3:.1f} ms; "
          f"an engine with that dense half and everything else free could reach at most {cap:.2f}x")
    steady: dict[str, float] = {}  # sparsecore/torchrec at each --dense-device
    for key, name in (("steady", "steady state"), ("whole", "whole loop")):
        for variant in variants[1:]:
            runs = [s[key] / t[key] for s, t in zip(results[variant], torchrec)]
            if key == "steady":
                steady[variant[1]] = statistics.median(runs)
            print(f"  world {world} {name:<12}  torchrec {statistics.median(r[key] for r in torchrec):>8,.0f}  "
                  f"{label[variant]} {statistics.median(r[key] for r in results[variant]):>8,.0f} samples/s   "
                  f"{label[variant]}/torchrec {statistics.median(runs):.2f}x "
                  f"(runs: {', '.join(f'{r:.2f}' for r in runs)}; spread {min(runs):.2f}-{max(runs):.2f}; "
                  f"load {os.getloadavg()[0]:.2f})")
    programs = ", ".join(f"{label[v]} {statistics.median(r['programs'] for r in results[v]):g}" for v in variants[1:])
    print(f"  world {world} tpu programs dispatched per step and rank (median): {programs}, torchrec "
          f"{statistics.median(r['programs'] for r in torchrec):g} (it runs on the CPU)")
    if ("sparsecore", "auto") in results:
        print(f"  world {world} {auto_verdict(results['sparsecore', 'auto'], steady)}")


def auto_verdict(auto_runs: list[dict], steady: dict[str, float]) -> str:
    """Where ``--dense-device auto``'s runs put the towers, beside the forced placements' steady
    ratios (``steady``, by --dense-device), and whether auto's placement is the faster one within 5%."""
    picked = sorted({r["towers_on"] for r in auto_runs})
    line = f"--dense-device auto put the towers on {'/'.join(picked)}"
    forced = {towers: ratio for towers, ratio in steady.items() if towers != "auto"}
    if not forced:
        return line
    line += " (forced: " + ", ".join(f"{towers} {ratio:.2f}x" for towers, ratio in sorted(forced.items())) + ")"
    if len(picked) != 1:
        return line
    ratios = {picked[0]: steady["auto"], **forced}  # auto's own runs stand for its placement when not forced
    faster = ratios[picked[0]] * AUTO_TOLERANCE >= max(ratios.values())
    return line + ("; the faster placement (within 5%)" if faster else "; NOT the faster placement")

if __name__ == "__main__":
    quiet_box.run(main)
