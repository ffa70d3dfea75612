"""End-to-end ``torchrec-tpu train`` throughput: ``--engine sparsecore`` vs the stock TorchRec
DMP engine (``--engine torchrec``), same model, data, batch and optimizers, in one run.

Both runs go through ``run_job`` on the same synthetic Parquet files (generated once into a
temporary directory), so samples/s covers the reader, the host preprocessing, the training steps
and the updates (evaluation excluded), world size 1. Timings on a shared 2-core box are noisy.

    .venv/bin/python bench/bench_train_e2e.py [--rows 65536] [--batch-size 512] [--model dlrm]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Sequence

from pipelines.synthetic import SyntheticConfig, generate
from torchrec_tpu.train.config import MODELS, TrainConfig
from torchrec_tpu.train.job import JobSummary, run_job


def run_engine(engine: str, data: Path, out: Path, args: argparse.Namespace) -> JobSummary:
    config = TrainConfig(
        engine=engine, model=args.model, data=str(data), log_dir=str(out / engine), eval_files=1,
        num_embeddings=args.num_embeddings, embedding_dim=16, dense_arch="64,16", over_arch="64,32,1",
        batch_size=args.batch_size, eval_batch_size=args.batch_size, epochs=1, max_steps=args.steps,
        num_threads=args.threads, progress=True,
    )
    return run_job(config)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=65536, help="synthetic rows, 1/4 held out (default: 65536)")
    parser.add_argument("--batch-size", type=int, default=512, help="default: 512")
    parser.add_argument("--steps", type=int, default=0, help="stop after N steps (default 0: one epoch)")
    parser.add_argument("--num-embeddings", type=int, default=100_000, help="rows per table, at most")
    parser.add_argument("--model", choices=MODELS, default="dlrm")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    args = parser.parse_args(argv)
    if args.rows < 8 or args.batch_size < 1 or args.steps < 0 or args.threads < 0:
        parser.error("--rows >= 8, --batch-size >= 1, --steps >= 0 and --threads >= 0 are required")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_train_e2e_") as tmp:
        data = Path(tmp) / "data"
        generate(SyntheticConfig(num_rows=args.rows, rows_per_file=args.rows // 4,
                                 row_group_size=max(1, args.rows // 16),
                                 max_cardinality=args.num_embeddings), data, progress=True)
        results = {engine: run_engine(engine, data, Path(tmp), args) for engine in ("torchrec", "sparsecore")}
    reference = results["torchrec"].result.samples_per_sec
    print(f"train end to end, {args.model}, world 1, batch {args.batch_size}, {args.rows} rows, "
          f"{args.threads} thread(s); shared box, noisy")
    for engine, summary in results.items():
        r = summary.result
        print(f"  {engine:<10} {r.samples_per_sec:>9,.0f} samples/s  ({r.samples_per_sec / reference:.2f}x torchrec)  "
              f"steps {r.steps}  eval AUC {r.eval.auc:.4f}")


if __name__ == "__main__":
    main()
