"""Peak memory and throughput of ``torchrec-tpu train`` as the tables grow: ``--engine sparsecore`` and
the stock TorchRec DMP engine (``--engine torchrec``) side by side, at two or three table sizes.

The tables are MLPerf DLRM-DCNv2's 26 cardinalities capped at ``--caps`` (``torchrec-tpu data
generate --max-cardinality``; 100k: 0.92M rows, 1.5M: 10.1M rows, 5M: 29.2M rows), passed per
feature as ``--num-embeddings-per-feature``. Every run is fresh child processes (``run_job``: one
per rank of ``--world``, reader, steps, evaluation, checkpoint) started through a small watcher
process, whose ``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`` after the run exits is the largest
rank's peak RSS (the budget is then each rank's even share of the tables plus the fixed 2 GB).
Per run: peak RSS, that over the table bytes (fp32 weights alone) and over the issue's budget
``1.3 x (tables + slots) + 2 GB`` (then a line of its own: ``peak RSS within budget: yes`` or
``NO``), the steady samples/s (the logged windows after the first), and the wall and process CPU
ms per step after the first window (CPU time, every thread's, is the figure that survives a loaded
box); per size the sparsecore/torchrec ratios, per engine each
size's step cost over the smallest's (issue 48: within 15% from 1M to 29M rows). Shared 2-core
box: timings are noisy, and a run at 29M rows needs ~10 GB free (check ``free -g``).

    .venv/bin/python bench/bench_scale.py [--caps 100000 1500000 5000000] [--steps 30] [--engines ...] [--world 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import quiet_box

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train_e2e import _free_port, engine_env, steady_rate  # noqa: E402  (bench/ is not a package)

ENGINES = ("torchrec", "sparsecore")
GB = 1 << 30
FIXED_SHARE = 2 * GB  # the process's own share in the budget: torch, JAX, the data pipeline


class StepClock:
    """Wall and process CPU time (every thread's: reader, dispatch, XLA's pool) at each training
    step's start; over a window of steps both are per-step costs (a CPU second is the same on a
    quiet box and a loaded one, wall seconds are not)."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, float]] = []

    def wrap(self, engine: Any) -> Any:
        """``engine`` with its step function timed."""
        clock = self

        class Timed:
            def __getattr__(self, name: str) -> Any:
                return getattr(engine, name)

            def step_function(self, *args: Any) -> Any:
                step = engine.step_function(*args)

                def timed(*step_args: Any) -> Any:
                    clock.marks.append((time.perf_counter(), time.process_time()))
                    return step(*step_args)

                return timed

        return Timed()

    def per_step_ms(self, skip: int) -> tuple[float, float]:
        """(wall, CPU) ms per step from step ``skip`` on (its start to the last step's start)."""
        (w0, c0), (w1, c1) = self.marks[skip], self.marks[-1]
        n = len(self.marks) - 1 - skip
        return 1e3 * (w1 - w0) / n, 1e3 * (c1 - c0) / n


def worker(args: argparse.Namespace) -> None:
    """One training run in this process; prints its steady samples/s and per-step costs as JSON."""
    import torchrec_tpu.train.job as job
    from torchrec_tpu.train.config import TrainConfig
    from torchrec_tpu.train.job import run_job

    clock = StepClock()
    engine_for = job.engine_for
    job.engine_for = lambda config: clock.wrap(engine_for(config))

    config = TrainConfig.from_options(
        engine=args.engine, data=args.data, log_dir=args.log_dir, eval_files=1, eval_batch_size=args.batch_size,
        num_embeddings_per_feature=args.sizes, embedding_dim=args.dim, dense_arch=f"64,{args.dim}",
        batch_size=args.batch_size, epochs=1, max_steps=args.steps, log_every=args.log_every, progress=False,
        sparse_optimizer=args.optimizer, dense_device=args.dense_device)
    summary = run_job(config)
    if summary.primary:
        wall_ms, cpu_ms = clock.per_step_ms(args.log_every)
        print(json.dumps({"steady": steady_rate(Path(args.log_dir)), "steps": summary.result.steps,
                          "wall_ms": wall_ms, "cpu_ms": cpu_ms}))


def watch(command: list[str], world: int) -> None:
    """Run ``command`` as this process's only children, one per rank of ``world`` (loopback);
    print rank 0's output's last line and the largest rank's peak RSS (bytes) as JSON."""
    env = dict(os.environ)
    if world > 1:
        env.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()))
    procs = [subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)} if world > 1 else env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    outputs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outputs):
        if p.returncode:
            sys.stderr.write(err[-4000:])
            sys.exit(p.returncode)
    result = json.loads(outputs[0][0].strip().splitlines()[-1])
    # (RUSAGE_CHILDREN: the largest of the waited-for children's peaks; KiB on Linux)
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(json.dumps(result))


def run(engine: str, data: Path, sizes: str, log_dir: Path, args: argparse.Namespace) -> dict:
    """One fresh run of ``engine``: its steady samples/s and peak RSS."""
    cmd = [sys.executable, __file__, "--worker", "--engine", engine, "--data", str(data), "--log-dir", str(log_dir),
           "--sizes", sizes, "--dim", str(args.dim), "--batch-size", str(args.batch_size), "--steps",
           str(args.steps), "--log-every", str(args.log_every), "--optimizer", args.optimizer, "--dense-device",
           args.dense_device]
    done = subprocess.run([sys.executable, __file__, "--watch", "--world", str(args.world), "--", *cmd],
                          env=engine_env(engine), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise RuntimeError(f"{engine} at {sizes.count(',') + 1} tables failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def budget_line(what: str, peak_rss: float, budget: float) -> str:
    """``what``'s verdict on the issue's memory budget, in words a reader cannot miss."""
    return (f"  {what}: peak RSS within budget: {'yes' if peak_rss <= budget else 'NO'} ({peak_rss / GB:.2f} GB = "
            f"{peak_rss / budget:.2f}x of {budget / GB:.2f} GB)")


def slot_bytes_per_row(optimizer: str, dim: int) -> int:
    """fp32 bytes of the optimizer's slots per table row."""
    from tpu_facts import OPTIMIZER_SLOTS

    element, row = OPTIMIZER_SLOTS[optimizer]
    return 4 * (len(element) * dim + len(row))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--caps", type=int, nargs="+", default=[100_000, 1_500_000],
                        help="max cardinality per table, one table size per cap (default: 100000 1500000; "
                             "5000000 is MLPerf's 29.2M rows)")
    parser.add_argument("--rows", type=int, default=131_072, help="synthetic rows per dataset (default: 131072)")
    parser.add_argument("--dim", type=int, default=32, help="embedding dim (default: 32)")
    parser.add_argument("--batch-size", type=int, default=2048, help="batch (default: 2048)")
    parser.add_argument("--steps", type=int, default=30, help="training steps per run (default: 30)")
    parser.add_argument("--log-every", type=int, default=5, help="steps per logged throughput window (default: 5)")
    parser.add_argument("--optimizer", default="rowwise_adagrad", help="--sparse-optimizer (default: rowwise_adagrad)")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES), help="(default: both)")
    parser.add_argument("--dense-device", choices=("auto", "cpu", "tpu"), default="auto",
                        help="the sparsecore engine's --dense-device (default: auto)")
    parser.add_argument("--world", type=int, default=1, help="ranks (loopback processes); peak RSS is the largest "
                        "rank's, the budget each rank's even share (default: 1)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--watch", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--log-dir", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    parser.add_argument("command", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.caps) < 1 or args.rows < args.batch_size or args.steps < 2 * args.log_every or args.world < 1:
        parser.error("--caps >= 1, --rows >= --batch-size, --steps >= 2 x --log-every and --world >= 1 are required")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.watch:
        watch(args.command, args.world)
        return
    if args.worker:
        worker(args)
        return
    from pipelines.synthetic import SyntheticConfig, generate

    print(f"train at scale: dim {args.dim}, batch {args.batch_size}, {args.optimizer}, {args.steps} steps, "
          f"{args.world} rank(s), "
          f"fresh process per run; load {os.getloadavg()[0]:.2f}; shared box, noisy")
    by_size: dict[str, list[tuple[float, dict]]] = {engine: [] for engine in args.engines}
    for cap in args.caps:
        with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
            config = SyntheticConfig(num_rows=args.rows, rows_per_file=args.rows // 2,
                                     row_group_size=max(1, args.rows // 8), max_cardinality=cap)
            generate(config, Path(tmp) / "data", progress=False)
            rows = sum(config.table_sizes)
            table_bytes = rows * args.dim * 4
            per_rank = (table_bytes + rows * slot_bytes_per_row(args.optimizer, args.dim)) / args.world
            budget = 1.3 * per_rank + FIXED_SHARE
            sizes = ",".join(map(str, config.table_sizes))
            results = {}
            for engine in args.engines:
                r = results[engine] = run(engine, Path(tmp) / "data", sizes, Path(tmp) / engine, args)
                by_size[engine].append((rows, r))
                print(f"  {rows / 1e6:5.1f}M rows ({table_bytes / GB:.2f} GB tables)  {engine:<10}  peak RSS "
                      f"{r['peak_rss'] / GB:5.2f} GB = {r['peak_rss'] / table_bytes:4.1f}x tables, "
                      f"{r['peak_rss'] / budget:4.2f}x budget ({budget / GB:.2f} GB)  steady "
                      f"{r['steady']:>8,.0f} samples/s, step {r['wall_ms']:5.1f} ms wall {r['cpu_ms']:6.1f} ms CPU",
                      flush=True)
                print(budget_line(f"{rows / 1e6:.1f}M rows {engine}", r["peak_rss"], budget), flush=True)
            if len(results) == 2:
                s, t = results["sparsecore"], results["torchrec"]
                print(f"  {rows / 1e6:5.1f}M rows  sparsecore/torchrec: samples/s {s['steady'] / t['steady']:.2f}x, "
                      f"CPU/step {t['cpu_ms'] / s['cpu_ms']:.2f}x, peak RSS {s['peak_rss'] / t['peak_rss']:.2f}x; "
                      f"load {os.getloadavg()[0]:.2f}", flush=True)
    for engine, runs in by_size.items():
        if len(runs) > 1:
            (rows0, first), rest = runs[0], runs[1:]
            print(f"  {engine}: step cost vs {rows0 / 1e6:.1f}M rows: " + ", ".join(
                f"{rows / 1e6:.1f}M {r['cpu_ms'] / first['cpu_ms']:.2f}x CPU, {r['wall_ms'] / first['wall_ms']:.2f}x "
                "wall" for rows, r in rest), flush=True)


if __name__ == "__main__":
    quiet_box.run(main)
